//! The caller side of the request plane: one multiplexed TCP connection to one worker.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use kvroute_protocols::SessionControl;
use kvroute_protocols::WorkerId;
use kvroute_protocols::WorkerLoadReport;
use kvroute_protocols::kv_events::RouterEvent;
use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::error::RequestError;
use crate::fleet_secret::{self, FleetSecret, Side};
use crate::fleet_tls::{self, FleetTls, ReadHalf};
use crate::frame::{self, CancelKind, Frame, HelloAck, Kind, WireError, WireErrorCode};
use crate::kv_publisher::KvDump;
use crate::server::write_loop;

mod stream;

pub use stream::ClientStream;

/// How a [`Client`] connects and waits.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The largest frame sent or accepted, in bytes.
    pub max_frame_bytes: usize,
    /// How long the TCP connect plus handshake may take.
    pub connect_timeout: Duration,
    /// How long a stream may wait for its first item (or end, or error) before it is killed and
    /// fails with [`RequestError::FirstResponseTimeout`]; also bounds unary calls. `None` waits
    /// forever.
    pub first_response_timeout: Option<Duration>,
    /// How often to probe an otherwise quiet connection. A connection on which nothing at all
    /// arrives for three intervals is declared dead (every stream on it ends with
    /// [`RequestError::WorkerUnavailable`]): this catches a worker host that vanished without
    /// closing its sockets. `None` relies on TCP alone.
    pub keepalive_interval: Option<Duration>,
    /// The fleet's secret: with one, the client talks only to workers that prove it, and proves
    /// it in turn (see [`crate::FleetSecret`]); without one, a worker that requires it refuses
    /// the connection ([`RequestError::Handshake`]).
    pub fleet_secret: Option<FleetSecret>,
    /// Mutual TLS: with it, the client connects over TLS, presents its certificate and accepts
    /// only workers with a certificate of the fleet's CA naming their address.
    pub tls: Option<FleetTls>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: frame::DEFAULT_MAX_FRAME_BYTES,
            connect_timeout: Duration::from_secs(5),
            first_response_timeout: Some(Duration::from_secs(60)),
            keepalive_interval: Some(Duration::from_secs(5)),
            fleet_secret: None,
            tls: None,
        }
    }
}

/// A connection to one worker over which any number of request streams and calls run
/// concurrently. Cheap to clone; the connection closes when the last clone is dropped.
///
/// When the connection drops, every open stream ends with [`RequestError::WorkerUnavailable`] and
/// later calls fail the same way at once ([`Client::is_closed`]); reconnecting is the caller's
/// (usually the push router's) decision.
///
/// Flow control is per connection, not per stream: the reader never waits for a slow stream
/// consumer (so one slow consumer cannot stall the others), which means a stream whose consumer
/// stops reading buffers what its engine sends. Consumers are expected to read or drop.
pub struct Client<Req, Resp> {
    conn: Arc<Connection>,
    _types: PhantomData<fn(Req) -> Resp>,
}

impl<Req, Resp> Clone for Client<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            _types: PhantomData,
        }
    }
}

impl<Req, Resp> std::fmt::Debug for Client<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.conn.addr)
            .field("worker_id", &self.conn.worker_id)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// What the reader task hands a stream.
enum Incoming {
    Item(Bytes),
    Reply(Bytes),
    End,
    Failed(RequestError),
}

struct Connection {
    addr: String,
    worker_id: WorkerId,
    config: ClientConfig,
    tx: mpsc::Sender<Bytes>,
    next_stream: AtomicU64,
    slots: Mutex<Slots>,
    reader: tokio::task::AbortHandle,
}

struct Slots {
    open: HashMap<u64, mpsc::UnboundedSender<Incoming>>,
    /// Why the connection closed; `Some` once it has.
    closed: Option<String>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl<Req, Resp> Client<Req, Resp> {
    /// The worker id the worker announced in the handshake.
    pub fn worker_id(&self) -> WorkerId {
        self.conn.worker_id
    }

    /// The address this client is connected to.
    pub fn addr(&self) -> &str {
        &self.conn.addr
    }

    /// Whether the connection has closed (every call now fails with `WorkerUnavailable`).
    pub fn is_closed(&self) -> bool {
        self.conn.slots.lock().closed.is_some()
    }

    /// How many streams and calls are open on this connection.
    pub fn open_streams(&self) -> usize {
        self.conn.slots.lock().open.len()
    }
}

impl<Req, Resp> Client<Req, Resp>
where
    Req: Serialize,
    Resp: DeserializeOwned,
{
    /// Connects to the worker at `addr` and performs the handshake.
    pub async fn connect(addr: &str, config: ClientConfig) -> Result<Self, RequestError> {
        let after = config.connect_timeout;
        match tokio::time::timeout(after, Connection::open(addr, config)).await {
            Ok(conn) => Ok(Self {
                conn: conn?,
                _types: PhantomData,
            }),
            Err(_) => Err(RequestError::ConnectTimeout {
                addr: addr.to_owned(),
                after,
            }),
        }
    }

    /// Sends `request` as a new stream; the worker's engine sees `request_id` in its context.
    pub async fn generate(
        &self,
        request_id: &str,
        request: &Req,
    ) -> Result<ClientStream<Resp>, RequestError> {
        let body = EncodedRequest::new(request_id, request, self.conn.config.max_frame_bytes)?;
        self.generate_encoded(&body).await
    }

    /// Sends an already encoded request (see [`EncodedRequest`]): lets a router retry on another
    /// worker without encoding twice.
    pub async fn generate_encoded(
        &self,
        request: &EncodedRequest,
    ) -> Result<ClientStream<Resp>, RequestError> {
        let (id, rx) = self.conn.open_slot()?;
        let f = frame::encode_raw(Kind::Request, id, &request.body);
        if self.conn.tx.send(f).await.is_err() {
            self.conn.slots.lock().open.remove(&id);
            return Err(self.conn.unavailable());
        }
        Ok(ClientStream::new(self.conn.clone(), id, rx))
    }

    /// Opens or closes an engine session on the worker.
    pub async fn session_control(&self, control: &SessionControl) -> Result<(), RequestError> {
        self.conn.call(Kind::SessionControl, control).await
    }

    /// Asks the worker for its held KV events with ids in `from..=to` (gap recovery).
    pub async fn kv_events_range(
        &self,
        from: u64,
        to: u64,
    ) -> Result<Vec<RouterEvent>, RequestError> {
        self.conn.call(Kind::EventsRange, &(from, to)).await
    }

    /// Opens a long-lived stream of the worker's KV events: the events it still holds from id
    /// `from` on (`None`: none), then each event as it is published, in id order, until the
    /// stream is dropped or the connection closes. There is no first-response timeout (a quiet
    /// worker publishes nothing); the connection's keepalive detects a dead worker. A gap in the
    /// ids means the feed fell behind: fetch the missing ids with [`Client::kv_events_range`].
    /// Fails with [`RequestError::EventsUnavailable`] when `from` was already evicted.
    pub async fn subscribe_kv_events(
        &self,
        from: Option<u64>,
    ) -> Result<ClientStream<RouterEvent>, RequestError> {
        self.open_feed(Kind::SubscribeKvEvents, &from).await
    }

    /// Opens a long-lived stream of the worker's load reports (see
    /// [`crate::LoadReporter::subscribe`]): every rank's latest at once, then on every change
    /// and every heartbeat, until the stream is dropped or the connection closes. Only call it
    /// on a worker whose metadata states [`crate::LOAD_REPORTS_METADATA`] `= "true"`: an older
    /// worker does not know the call and drops the connection. Fails with
    /// [`RequestError::Unsupported`] when the worker sends no reports.
    pub async fn subscribe_load_reports(
        &self,
    ) -> Result<ClientStream<WorkerLoadReport>, RequestError> {
        self.open_feed(Kind::SubscribeLoadReports, &()).await
    }

    /// Opens a long-lived stream of `kind` (a subscription), with no first-response deadline.
    async fn open_feed<T, B: Serialize>(
        &self,
        kind: Kind,
        body: &B,
    ) -> Result<ClientStream<T>, RequestError> {
        let (id, rx) = self.conn.open_slot()?;
        let sent = match frame::encode(kind, id, body, self.conn.config.max_frame_bytes) {
            Ok(f) => self
                .conn
                .tx
                .send(f)
                .await
                .map_err(|_| self.conn.unavailable()),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            self.conn.slots.lock().open.remove(&id);
            return Err(e);
        }
        Ok(ClientStream::without_deadline(self.conn.clone(), id, rx))
    }

    /// Asks the worker for everything its engine holds (a late-joining router's rebuild).
    pub async fn kv_dump(&self) -> Result<KvDump, RequestError> {
        self.conn.call(Kind::KvDump, &()).await
    }
}

/// A request encoded once, ready to be sent on any connection.
#[derive(Debug, Clone)]
pub struct EncodedRequest {
    body: Bytes,
}

impl EncodedRequest {
    /// Encodes `request` with its id, refusing it if it would not fit in `max_frame_bytes`.
    pub fn new<Req: Serialize>(
        request_id: &str,
        request: &Req,
        max_frame_bytes: usize,
    ) -> Result<Self, RequestError> {
        let f = frame::encode(Kind::Request, 0, &(request_id, request), max_frame_bytes)?;
        Ok(Self {
            body: f.slice(frame::HEADER_LEN..),
        })
    }

    /// The encoded size in bytes.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    /// Whether the encoding is empty (never, for a real request).
    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }
}

impl Connection {
    async fn open(addr: &str, config: ClientConfig) -> Result<Arc<Connection>, RequestError> {
        let unavailable = |reason: String| RequestError::WorkerUnavailable {
            addr: addr.to_owned(),
            reason,
        };
        let handshake = |message: String| RequestError::Handshake {
            addr: addr.to_owned(),
            message,
        };
        let socket = TcpStream::connect(addr)
            .await
            .map_err(|e| unavailable(format!("connect failed: {e}")))?;
        let _ = socket.set_nodelay(true);
        let max = config.max_frame_bytes;
        let (read_half, write_half) = match &config.tls {
            None => fleet_tls::plain(socket),
            Some(tls) => tls
                .connect(addr, socket)
                .await
                .map_err(|e| handshake(format!("TLS with the worker failed: {e}")))?,
        };
        let mut reader = FramedRead::new(read_half, frame::codec(max));
        let mut writer = FramedWrite::new(write_half, frame::codec(max));
        let own_nonce = fleet_secret::nonce();
        writer
            .send(frame::encode_raw(
                Kind::Hello,
                0,
                &frame::hello_body(&own_nonce),
            ))
            .await
            .map_err(|e| unavailable(format!("sending hello failed: {e}")))?;
        let ack: HelloAck = match reader.next().await {
            None => return Err(unavailable("closed during the handshake".to_owned())),
            Some(Err(e)) => return Err(handshake(format!("unreadable hello reply: {e}"))),
            Some(Ok(raw)) => match Frame::parse(raw) {
                Ok(f) if f.kind == Kind::HelloAck => {
                    frame::decode(&f.body, max).map_err(handshake)?
                }
                Ok(f) if f.kind == Kind::GoAway => {
                    return Err(handshake(String::from_utf8_lossy(&f.body).into_owned()));
                }
                Ok(f) => return Err(handshake(format!("expected a hello ack, got {:?}", f.kind))),
                Err(e) => return Err(handshake(e.to_string())),
            },
        };
        if ack.version != frame::PROTOCOL_VERSION {
            return Err(handshake(format!(
                "worker speaks protocol version {}, expected {}",
                ack.version,
                frame::PROTOCOL_VERSION
            )));
        }
        match (&config.fleet_secret, &ack.proof) {
            (None, None) => {}
            (None, Some(_)) => {
                return Err(handshake(
                    "the worker requires the fleet secret; pass the fleet's --fleet-secret-file"
                        .to_owned(),
                ));
            }
            (Some(secret), proof) => {
                let proven = proof.is_some_and(|proof| {
                    secret.verify(Side::Worker, &own_nonce, &ack.nonce, &proof)
                });
                if !proven {
                    return Err(handshake(format!(
                        "the worker did not prove the fleet secret ({}); nothing is sent to it",
                        if proof.is_some() {
                            "a wrong proof"
                        } else {
                            "it holds none"
                        }
                    )));
                }
                let proof = secret.prove(Side::Client, &ack.nonce, &own_nonce);
                writer
                    .send(frame::encode_raw(Kind::Auth, 0, &proof))
                    .await
                    .map_err(|e| unavailable(format!("sending the fleet proof failed: {e}")))?;
            }
        }
        let (tx, rx) = mpsc::channel::<Bytes>(1024);
        tokio::spawn(write_loop(writer, rx));
        let keepalive = config.keepalive_interval;
        let conn = Arc::new_cyclic(|weak: &std::sync::Weak<Connection>| {
            let reader_task = tokio::spawn(read_loop(
                reader,
                weak.clone(),
                max,
                keepalive.map(|i| i * 3),
            ));
            if let Some(interval) = keepalive {
                tokio::spawn(ping_loop(weak.clone(), interval));
            }
            Connection {
                addr: addr.to_owned(),
                worker_id: ack.worker_id,
                config,
                tx,
                next_stream: AtomicU64::new(1),
                slots: Mutex::new(Slots {
                    open: HashMap::new(),
                    closed: None,
                }),
                reader: reader_task.abort_handle(),
            }
        });
        Ok(conn)
    }

    fn unavailable(&self) -> RequestError {
        let reason = self
            .slots
            .lock()
            .closed
            .clone()
            .unwrap_or_else(|| "connection closed".to_owned());
        RequestError::WorkerUnavailable {
            addr: self.addr.clone(),
            reason,
        }
    }

    fn open_slot(&self) -> Result<(u64, mpsc::UnboundedReceiver<Incoming>), RequestError> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut slots = self.slots.lock();
        if let Some(reason) = &slots.closed {
            return Err(RequestError::WorkerUnavailable {
                addr: self.addr.clone(),
                reason: reason.clone(),
            });
        }
        slots.open.insert(id, tx);
        Ok((id, rx))
    }

    async fn call<T: Serialize + ?Sized, R: DeserializeOwned>(
        &self,
        kind: Kind,
        body: &T,
    ) -> Result<R, RequestError> {
        let max = self.config.max_frame_bytes;
        let (id, mut rx) = self.open_slot()?;
        let result = async {
            let f = frame::encode(kind, id, body, max)?;
            self.tx.send(f).await.map_err(|_| self.unavailable())?;
            let incoming = match self.config.first_response_timeout {
                Some(after) => tokio::time::timeout(after, rx.recv())
                    .await
                    .map_err(|_| RequestError::FirstResponseTimeout { after })?,
                None => rx.recv().await,
            };
            match incoming {
                Some(Incoming::Reply(body)) => {
                    frame::decode(&body, max).map_err(|message| RequestError::Decode { message })
                }
                Some(Incoming::Failed(e)) => Err(e),
                Some(Incoming::Item(_) | Incoming::End) => Err(RequestError::Decode {
                    message: "expected a reply, got a stream item".to_owned(),
                }),
                None => Err(self.unavailable()),
            }
        }
        .await;
        self.slots.lock().open.remove(&id);
        result
    }

    fn cancel(&self, id: u64, kind: CancelKind) {
        let f = frame::encode_raw(Kind::Cancel, id, &[kind as u8]);
        if let Err(mpsc::error::TrySendError::Full(f)) = self.tx.try_send(f) {
            // The writer is backed up; queue the cancel behind it rather than lose it.
            let tx = self.tx.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = tx.send(f).await;
                });
            }
        }
    }
}

/// Probes the connection every `interval` until it closes or the client is dropped. It holds
/// only a weak reference, so that it never keeps a dropped client's connection open.
async fn ping_loop(conn: std::sync::Weak<Connection>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(conn) = conn.upgrade() else { return };
        if conn.slots.lock().closed.is_some() {
            return;
        }
        // A full queue means frames are flowing anyway; skipping this probe loses nothing.
        if let Err(mpsc::error::TrySendError::Closed(_)) =
            conn.tx.try_send(frame::encode_raw(Kind::Ping, 0, &[]))
        {
            return;
        }
    }
}

async fn read_loop(
    mut reader: FramedRead<ReadHalf, tokio_util::codec::LengthDelimitedCodec>,
    conn: std::sync::Weak<Connection>,
    max: usize,
    dead_after: Option<Duration>,
) {
    let reason = loop {
        let next = match dead_after {
            Some(after) => match tokio::time::timeout(after, reader.next()).await {
                Ok(next) => next,
                Err(_) => {
                    break format!("nothing received from the worker for {after:?} (keepalive)");
                }
            },
            None => reader.next().await,
        };
        let raw = match next {
            None => break "connection closed by the worker".to_owned(),
            Some(Err(e)) => break format!("connection failed: {e}"),
            Some(Ok(raw)) => raw,
        };
        let f = match Frame::parse(raw) {
            Ok(f) => f,
            Err(e) => break format!("worker sent a malformed frame: {e}"),
        };
        let incoming = match f.kind {
            Kind::Pong => continue,
            Kind::Item => Incoming::Item(f.body),
            Kind::Reply => Incoming::Reply(f.body),
            Kind::End => Incoming::End,
            Kind::Error => Incoming::Failed(match frame::decode::<WireError>(&f.body, max) {
                Ok(e) => match conn.upgrade() {
                    Some(conn) => remote_error(e, &conn.addr),
                    None => remote_error(e, ""),
                },
                Err(message) => RequestError::Decode { message },
            }),
            Kind::GoAway => {
                break format!(
                    "worker closed the connection: {}",
                    String::from_utf8_lossy(&f.body)
                );
            }
            other => break format!("worker sent an unexpected {other:?} frame"),
        };
        let Some(conn) = conn.upgrade() else { return };
        let slots = conn.slots.lock();
        // A stream the caller already dropped or killed has no slot; late frames are ignored.
        if let Some(slot) = slots.open.get(&f.stream) {
            let _ = slot.send(incoming);
        }
    };
    let Some(conn) = conn.upgrade() else { return };
    let mut slots = conn.slots.lock();
    slots.closed = Some(reason.clone());
    for (_, slot) in slots.open.drain() {
        let _ = slot.send(Incoming::Failed(RequestError::WorkerUnavailable {
            addr: conn.addr.clone(),
            reason: reason.clone(),
        }));
    }
}

pub(crate) fn remote_error(e: WireError, addr: &str) -> RequestError {
    let message = e.message;
    match e.code {
        WireErrorCode::EngineUnavailable => RequestError::WorkerUnavailable {
            addr: addr.to_owned(),
            reason: message,
        },
        WireErrorCode::EngineUnreachable => RequestError::EngineUnreachable {
            addr: addr.to_owned(),
            reason: message,
        },
        WireErrorCode::EngineTimeout => RequestError::EngineTimeout {
            addr: addr.to_owned(),
            reason: message,
        },
        WireErrorCode::Engine => RequestError::Engine { message },
        WireErrorCode::BadRequest => RequestError::BadRequest { message },
        WireErrorCode::TooLarge => RequestError::Engine { message },
        WireErrorCode::Unsupported => RequestError::Unsupported { message },
        WireErrorCode::EventsUnavailable => RequestError::EventsUnavailable { message },
        WireErrorCode::TooManyStreams => RequestError::TooManyStreams { message },
    }
}
