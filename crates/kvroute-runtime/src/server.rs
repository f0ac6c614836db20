//! The worker side of the request plane: serves an [`Engine`] over TCP.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use kvroute_protocols::SessionControl;
use kvroute_protocols::WorkerId;
use kvroute_protocols::kv_events::RouterEvent;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc};
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::engine::{Engine, EngineError, RequestContext};
use crate::fleet_secret::{self, FleetSecret, Side};
use crate::fleet_tls::{self, FleetTls, ReadHalf};
use crate::frame::{self, CancelKind, Frame, HelloAck, Kind, WireError, WireErrorCode};
use crate::kv_publisher::{KvEventPublisher, RangeError};
use crate::load_reporter::LoadReporter;

/// How a [`WorkerServer`] runs.
#[derive(Debug, Clone)]
pub struct WorkerServerConfig {
    /// The worker's instance id, told to clients in the handshake.
    pub worker_id: WorkerId,
    /// The largest frame accepted or sent, in bytes.
    pub max_frame_bytes: usize,
    /// How long a new connection may take to send its hello.
    pub handshake_timeout: Duration,
    /// The most streams one connection may have running at once; more are refused with
    /// [`crate::RequestError::TooManyStreams`], so one caller cannot exhaust the worker's tasks.
    pub max_streams_per_connection: usize,
    /// The KV event publisher whose ring answers gap-recovery calls; without one those calls are
    /// answered as unsupported.
    pub kv_events: Option<KvEventPublisher>,
    /// The reporter whose load reports `subscribe_load_reports` streams; without one that call
    /// is answered as unsupported.
    pub load_reports: Option<LoadReporter>,
    /// The fleet's secret: with one, this server proves it in every handshake and serves only
    /// clients that prove it too (see [`crate::FleetSecret`]); others are refused and logged.
    pub fleet_secret: Option<FleetSecret>,
    /// Mutual TLS: with it, connections are TLS, and only clients with a certificate of the
    /// fleet's CA are served (see [`crate::FleetTls`]).
    pub tls: Option<FleetTls>,
}

impl WorkerServerConfig {
    /// Defaults for `worker_id`: [`crate::DEFAULT_MAX_FRAME_BYTES`] frames, a 5 s handshake
    /// timeout, 65,536 streams per connection, no KV events.
    pub fn new(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            max_frame_bytes: frame::DEFAULT_MAX_FRAME_BYTES,
            handshake_timeout: Duration::from_secs(5),
            max_streams_per_connection: 65_536,
            kv_events: None,
            load_reports: None,
            fleet_secret: None,
            tls: None,
        }
    }

    /// The same config serving over mutual TLS (none: plain TCP).
    pub fn with_tls(mut self, tls: Option<FleetTls>) -> Self {
        self.tls = tls;
        self
    }

    /// The same config requiring (and proving) the fleet secret.
    pub fn with_fleet_secret(mut self, secret: Option<FleetSecret>) -> Self {
        self.fleet_secret = secret;
        self
    }

    /// The same config answering gap-recovery and dump calls from `publisher`.
    pub fn with_kv_events(mut self, publisher: KvEventPublisher) -> Self {
        self.kv_events = Some(publisher);
        self
    }

    /// The same config streaming `reporter`'s load reports to subscribers.
    pub fn with_load_reports(mut self, reporter: LoadReporter) -> Self {
        self.load_reports = Some(reporter);
        self
    }
}

/// A running worker server. Dropping it (or [`WorkerServer::abort`]) closes the listener and every
/// connection at once, which is what a crashed worker looks like to its callers.
#[derive(Debug)]
pub struct WorkerServer {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl WorkerServer {
    /// Binds `addr` (use port 0 for an ephemeral port) and serves `engine` on it.
    pub async fn bind<E: Engine>(
        addr: impl tokio::net::ToSocketAddrs,
        engine: Arc<E>,
        config: WorkerServerConfig,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Self::serve(listener, engine, config))
    }

    /// Serves `engine` on an already bound listener.
    pub fn serve<E: Engine>(
        listener: TcpListener,
        engine: Arc<E>,
        config: WorkerServerConfig,
    ) -> Self {
        let local_addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let shared = Arc::new(Shared { engine, config });
        let task = tokio::spawn(accept_loop(listener, shared));
        Self { local_addr, task }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting and drops every connection and in-flight stream now.
    pub fn abort(&self) {
        self.task.abort();
    }
}

impl Drop for WorkerServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Shared<E> {
    engine: Arc<E>,
    config: WorkerServerConfig,
}

async fn accept_loop<E: Engine>(listener: TcpListener, shared: Arc<Shared<E>>) {
    // Connections live in this set so that aborting the accept task drops all of them.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    let _ = socket.set_nodelay(true);
                    connections.spawn(serve_connection(socket, peer, shared.clone()));
                }
                Err(error) => {
                    // Accept errors (e.g. too many open files) are transient; back off briefly.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

struct StreamEntry {
    context: RequestContext,
    task: AbortHandle,
}

/// The first byte of a TLS connection (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

async fn serve_connection<E: Engine>(socket: TcpStream, peer: SocketAddr, shared: Arc<Shared<E>>) {
    let max = shared.config.max_frame_bytes;
    let (read_half, write_half) = match &shared.config.tls {
        None => fleet_tls::plain(socket),
        Some(tls) => {
            // A client speaking plain TCP is told so in its own protocol, so it fails with
            // the reason instead of a closed connection.
            let mut first = [0u8; 1];
            let peeked =
                tokio::time::timeout(shared.config.handshake_timeout, socket.peek(&mut first))
                    .await;
            if !matches!(peeked, Ok(Ok(1))) || first[0] != TLS_HANDSHAKE_RECORD {
                tracing::warn!(%peer, "refused a plain-TCP request-plane connection: this worker requires TLS");
                let mut socket = socket;
                let message = "this worker serves the request plane over TLS only (--fleet-ca, --fleet-cert, --fleet-key)";
                let mut frame = frame::encode_raw(Kind::GoAway, 0, message.as_bytes()).to_vec();
                let mut out = (frame.len() as u32).to_be_bytes().to_vec();
                out.append(&mut frame);
                let _ = tokio::io::AsyncWriteExt::write_all(&mut socket, &out).await;
                return;
            }
            match tokio::time::timeout(shared.config.handshake_timeout, tls.accept(socket)).await {
                Ok(Ok(halves)) => halves,
                Ok(Err(error)) => {
                    tracing::warn!(%peer, %error, "refused a request-plane connection: its TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, "refused a request-plane connection: no TLS handshake in time");
                    return;
                }
            }
        }
    };
    let mut reader = FramedRead::new(read_half, frame::codec(max));
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    let writer = tokio::spawn(write_loop(
        FramedWrite::new(write_half, frame::codec(max)),
        rx,
    ));

    let outcome = match tokio::time::timeout(shared.config.handshake_timeout, reader.next()).await {
        Ok(Some(Ok(raw))) => match Frame::parse(raw) {
            Ok(f) if f.kind == Kind::Hello => frame::check_hello(&f.body),
            Ok(f) => Err(format!("expected a hello frame first, got {:?}", f.kind)),
            Err(e) => Err(e.to_string()),
        },
        Ok(Some(Err(e))) => Err(format!("unreadable hello frame: {e}")),
        Ok(None) => Err("connection closed before hello".to_owned()),
        Err(_) => Err("no hello within the handshake timeout".to_owned()),
    };
    let outcome = match outcome {
        Ok(client_nonce) => {
            let own_nonce = fleet_secret::nonce();
            let secret = shared.config.fleet_secret.as_ref();
            let ack = HelloAck {
                version: frame::PROTOCOL_VERSION,
                worker_id: shared.config.worker_id,
                max_frame_bytes: max as u64,
                nonce: own_nonce,
                proof: secret.map(|s| s.prove(Side::Worker, &client_nonce, &own_nonce)),
            };
            if let Ok(f) = frame::encode(Kind::HelloAck, 0, &ack, max) {
                let _ = tx.send(f).await;
            }
            match secret {
                None => run_streams(&mut reader, &tx, &shared).await,
                Some(secret) => {
                    match client_proof(&mut reader, shared.config.handshake_timeout).await {
                        Ok(proof)
                            if secret.verify(Side::Client, &own_nonce, &client_nonce, &proof) =>
                        {
                            run_streams(&mut reader, &tx, &shared).await
                        }
                        refused => {
                            let why = refused.err().unwrap_or_else(|| "a wrong proof".to_owned());
                            tracing::warn!(
                                %peer,
                                why,
                                "refused a request-plane connection without the fleet secret"
                            );
                            Err("this worker serves only clients holding the fleet secret \
                                 (--fleet-secret-file)"
                                .to_owned())
                        }
                    }
                }
            }
        }
        Err(message) => Err(message),
    };
    if let Err(message) = outcome {
        tracing::debug!(%peer, %message, "closing request-plane connection");
        let _ = tx
            .send(frame::encode_raw(Kind::GoAway, 0, message.as_bytes()))
            .await;
    }
    drop(tx);
    // Let the writer flush what is queued (the go-away above) before the socket closes.
    let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
}

/// The client's [`Kind::Auth`] proof, the first frame after the acknowledgement.
async fn client_proof(
    reader: &mut FramedRead<ReadHalf, tokio_util::codec::LengthDelimitedCodec>,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    match tokio::time::timeout(timeout, reader.next()).await {
        Ok(Some(Ok(raw))) => match Frame::parse(raw) {
            Ok(f) if f.kind == Kind::Auth => Ok(f.body.to_vec()),
            Ok(f) => Err(format!("no proof: {:?} came first", f.kind)),
            Err(e) => Err(e.to_string()),
        },
        Ok(Some(Err(e))) => Err(format!("unreadable frame: {e}")),
        Ok(None) => Err("closed before its proof".to_owned()),
        Err(_) => Err("no proof within the handshake timeout".to_owned()),
    }
}

/// Reads frames until the peer closes (Ok) or violates the protocol (Err with a message for it).
async fn run_streams<E: Engine>(
    reader: &mut FramedRead<ReadHalf, tokio_util::codec::LengthDelimitedCodec>,
    tx: &mpsc::Sender<Bytes>,
    shared: &Arc<Shared<E>>,
) -> Result<(), String> {
    let max = shared.config.max_frame_bytes;
    let mut streams = Streams {
        tx,
        shared,
        max,
        tasks: JoinSet::new(),
        running: HashMap::new(),
    };
    // Every stream still running when this returns is killed: its engine stream is dropped with
    // the JoinSet, and its context says so for engines that watch it.
    let result = loop {
        let next = tokio::select! {
            raw = reader.next() => Next::Frame(raw),
            Some(done) = streams.tasks.join_next(), if !streams.tasks.is_empty() => Next::Ended(done),
        };
        let raw = match next {
            Next::Ended(done) => {
                streams.ended(done).await;
                continue;
            }
            Next::Frame(raw) => raw,
        };
        let raw = match raw {
            None => break Ok(()),
            Some(Ok(raw)) => raw,
            Some(Err(e)) => {
                break Err(format!(
                    "refusing frame: {e} (maximum frame size is {max} bytes)"
                ));
            }
        };
        let f = match Frame::parse(raw) {
            Ok(f) => f,
            Err(e) => break Err(format!("refusing frame: {e}")),
        };
        if let Err(e) = streams.handle(f).await {
            break Err(e);
        }
    };
    for entry in streams.running.values() {
        entry.context.kill();
    }
    result
}

/// What [`run_streams`] waits for next: a frame from the peer or the end of a stream's task.
enum Next {
    Frame(Option<Result<bytes::BytesMut, std::io::Error>>),
    Ended(Result<u64, tokio::task::JoinError>),
}

/// One connection's running streams (engine requests and feeds), and where their frames go.
struct Streams<'a, E: Engine> {
    tx: &'a mpsc::Sender<Bytes>,
    shared: &'a Arc<Shared<E>>,
    max: usize,
    tasks: JoinSet<u64>,
    running: HashMap<u64, StreamEntry>,
}

impl<E: Engine> Streams<'_, E> {
    /// Forgets a stream whose task ended.
    async fn ended(&mut self, done: Result<u64, tokio::task::JoinError>) {
        match done {
            Ok(id) => {
                self.running.remove(&id);
            }
            // A panicked engine stream: find it by task id and fail it for the caller.
            Err(e) => {
                let id = self
                    .running
                    .iter()
                    .find(|(_, s)| s.task.id() == e.id())
                    .map(|(id, _)| *id);
                if let Some(id) = id {
                    self.running.remove(&id);
                    let message = "the engine stream panicked".to_owned();
                    send_error(self.tx, id, WireErrorCode::Engine, message, self.max).await;
                }
            }
        }
    }

    /// Serves one frame; an error ends the connection with that message.
    #[inline]
    async fn handle(&mut self, f: Frame) -> Result<(), String> {
        let (tx, max) = (self.tx, self.max);
        match f.kind {
            Kind::Request => self.request(f).await?,
            Kind::Cancel => self.cancel(&f)?,
            Kind::SessionControl => {
                let reply = match frame::decode::<SessionControl>(&f.body, max) {
                    Ok(control) => self
                        .shared
                        .engine
                        .session_control(control)
                        .map_err(engine_error),
                    Err(message) => Err(WireError {
                        code: WireErrorCode::BadRequest,
                        message,
                    }),
                };
                send_reply(tx, f.stream, reply, max).await;
            }
            Kind::EventsRange => {
                let reply = match (
                    frame::decode::<(u64, u64)>(&f.body, max),
                    &self.shared.config.kv_events,
                ) {
                    (Err(message), _) => Err(WireError {
                        code: WireErrorCode::BadRequest,
                        message,
                    }),
                    (Ok(_), None) => Err(no_kv_events()),
                    (Ok((from, to)), Some(publisher)) => {
                        publisher
                            .range(from, to)
                            .map_err(|e: RangeError| WireError {
                                code: WireErrorCode::EventsUnavailable,
                                message: e.to_string(),
                            })
                    }
                };
                send_reply(tx, f.stream, reply, max).await;
            }
            Kind::KvDump => {
                let reply = match &self.shared.config.kv_events {
                    None => Err(no_kv_events()),
                    Some(publisher) => Ok(publisher.dump_with(|| self.shared.engine.kv_dump())),
                };
                send_reply(tx, f.stream, reply, max).await;
            }
            Kind::SubscribeKvEvents => self.subscribe_kv_events(f).await?,
            Kind::SubscribeLoadReports => self.subscribe_load_reports(f).await?,
            Kind::Ping => {
                let _ = tx.send(frame::encode_raw(Kind::Pong, f.stream, &[])).await;
            }
            other => return Err(format!("a worker does not accept {other:?} frames")),
        }
        Ok(())
    }

    /// A stream id a new stream may take; in use, it ends the connection.
    fn check_free(&self, stream: u64) -> Result<(), String> {
        if self.running.contains_key(&stream) {
            return Err(format!("stream id {stream} is already in use"));
        }
        Ok(())
    }

    /// A request for the engine: runs it as a stream of its own, unless the connection runs
    /// the most streams allowed or the request cannot be decoded.
    #[inline]
    async fn request(&mut self, f: Frame) -> Result<(), String> {
        self.check_free(f.stream)?;
        let (tx, max) = (self.tx, self.max);
        let limit = self.shared.config.max_streams_per_connection;
        if self.running.len() >= limit {
            let message = format!("this connection already runs {limit} streams, the most allowed");
            send_error(tx, f.stream, WireErrorCode::TooManyStreams, message, max).await;
            return Ok(());
        }
        let decoded = frame::decode::<(String, E::Request)>(&f.body, max);
        let (request_id, request) = match decoded {
            Ok(pair) => pair,
            Err(message) => {
                send_error(tx, f.stream, WireErrorCode::BadRequest, message, max).await;
                return Ok(());
            }
        };
        let context = RequestContext::new(request_id);
        let task = self.tasks.spawn(run_stream(
            self.shared.clone(),
            f.stream,
            request,
            context.clone(),
            tx.clone(),
        ));
        self.running.insert(f.stream, StreamEntry { context, task });
        Ok(())
    }

    /// Stops a stream's generation, or kills it.
    fn cancel(&mut self, f: &Frame) -> Result<(), String> {
        let kind = frame::cancel_kind(&f.body).map_err(|m| format!("bad cancel frame: {m}"))?;
        match kind {
            CancelKind::Stop => {
                if let Some(entry) = self.running.get(&f.stream) {
                    entry.context.stop_generating();
                }
            }
            CancelKind::Kill => {
                if let Some(entry) = self.running.remove(&f.stream) {
                    entry.context.kill();
                    entry.task.abort();
                }
            }
        }
        Ok(())
    }

    /// Streams the KV events from the one asked for (the publisher's backlog, then live).
    async fn subscribe_kv_events(&mut self, f: Frame) -> Result<(), String> {
        self.check_free(f.stream)?;
        let (tx, max) = (self.tx, self.max);
        let feed = match (
            frame::decode::<Option<u64>>(&f.body, max),
            &self.shared.config.kv_events,
        ) {
            (Err(message), _) => Err(WireError {
                code: WireErrorCode::BadRequest,
                message,
            }),
            (Ok(_), None) => Err(no_kv_events()),
            (Ok(from), Some(publisher)) => publisher.subscribe(from).map_err(|e| WireError {
                code: WireErrorCode::EventsUnavailable,
                message: e.to_string(),
            }),
        };
        match feed {
            Err(e) => send_error(tx, f.stream, e.code, e.message, max).await,
            Ok((backlog, live)) => {
                let context = RequestContext::new("kv-events");
                let task = self.tasks.spawn(run_kv_feed(
                    f.stream,
                    backlog,
                    live,
                    context.clone(),
                    tx.clone(),
                    max,
                ));
                self.running.insert(f.stream, StreamEntry { context, task });
            }
        }
        Ok(())
    }

    /// Streams the worker's load reports.
    async fn subscribe_load_reports(&mut self, f: Frame) -> Result<(), String> {
        self.check_free(f.stream)?;
        let (tx, max) = (self.tx, self.max);
        match &self.shared.config.load_reports {
            None => {
                let e = WireError {
                    code: WireErrorCode::Unsupported,
                    message: "this worker sends no load reports".to_owned(),
                };
                send_error(tx, f.stream, e.code, e.message, max).await;
            }
            Some(reporter) => {
                let context = RequestContext::new("load-reports");
                let task = self.tasks.spawn(run_report_feed(
                    f.stream,
                    reporter.clone(),
                    context.clone(),
                    tx.clone(),
                    max,
                ));
                self.running.insert(f.stream, StreamEntry { context, task });
            }
        }
        Ok(())
    }
}

async fn run_stream<E: Engine>(
    shared: Arc<Shared<E>>,
    stream: u64,
    request: E::Request,
    context: RequestContext,
    tx: mpsc::Sender<Bytes>,
) -> u64 {
    let max = shared.config.max_frame_bytes;
    // However this task ends early (a kill, the connection dropping, the server aborting), the
    // engine is told through the context as well as by its stream being dropped.
    let guard = KillOnDrop(Some(context.clone()));
    let mut responses = match shared.engine.generate(request, context.clone()) {
        Ok(responses) => responses,
        Err(e) => {
            let e = engine_error(e);
            send_error(&tx, stream, e.code, e.message, max).await;
            return stream;
        }
    };
    while let Some(item) = responses.next().await {
        let f = match frame::encode(Kind::Item, stream, &item, max) {
            Ok(f) => f,
            Err(e) => {
                send_error(&tx, stream, WireErrorCode::TooLarge, e.to_string(), max).await;
                return stream;
            }
        };
        if tx.send(f).await.is_err() {
            return stream;
        }
    }
    match context.failure() {
        Some(e) => {
            let e = engine_error(e);
            send_error(&tx, stream, e.code, e.message, max).await;
        }
        None => {
            let _ = tx.send(frame::encode_raw(Kind::End, stream, &[])).await;
        }
    }
    guard.disarm();
    stream
}

/// Streams a KV event subscription: the backlog, then every event as it is published, until the
/// caller cancels or the connection closes. A feed that falls behind skips what it lost: the
/// event ids say so, and the subscriber recovers them with a range or dump call.
async fn run_kv_feed(
    stream: u64,
    backlog: Vec<RouterEvent>,
    mut live: broadcast::Receiver<RouterEvent>,
    context: RequestContext,
    tx: mpsc::Sender<Bytes>,
    max: usize,
) -> u64 {
    for event in &backlog {
        if !send_event(&tx, stream, event, max).await {
            return stream;
        }
    }
    loop {
        let event = tokio::select! {
            () = context.stopped() => break,
            event = live.recv() => event,
        };
        let event = match event {
            Ok(event) => event,
            Err(broadcast::error::RecvError::Lagged(lost)) => {
                tracing::warn!(lost, "a KV event subscriber fell behind; it will see a gap");
                continue;
            }
            Err(broadcast::error::RecvError::Closed) => break,
        };
        if !send_event(&tx, stream, &event, max).await {
            return stream;
        }
    }
    let _ = tx.send(frame::encode_raw(Kind::End, stream, &[])).await;
    stream
}

/// Streams a load-report subscription ([`LoadReporter::subscribe`]) until the caller cancels,
/// the connection closes or the reporter is dropped.
async fn run_report_feed(
    stream: u64,
    reporter: LoadReporter,
    context: RequestContext,
    tx: mpsc::Sender<Bytes>,
    max: usize,
) -> u64 {
    let mut reports = std::pin::pin!(reporter.subscribe());
    drop(reporter);
    loop {
        let report = tokio::select! {
            () = context.stopped() => break,
            report = reports.next() => report,
        };
        let Some(report) = report else { break };
        let sent = match frame::encode(Kind::Item, stream, &report, max) {
            Ok(f) => tx.send(f).await.is_ok(),
            Err(_) => true,
        };
        if !sent {
            return stream;
        }
    }
    let _ = tx.send(frame::encode_raw(Kind::End, stream, &[])).await;
    stream
}

/// Sends one event as a stream item; false once the connection is gone.
async fn send_event(
    tx: &mpsc::Sender<Bytes>,
    stream: u64,
    event: &RouterEvent,
    max: usize,
) -> bool {
    match frame::encode(Kind::Item, stream, event, max) {
        Ok(f) => tx.send(f).await.is_ok(),
        // An event too large for a frame cannot be sent; the subscriber sees a gap instead.
        Err(_) => true,
    }
}

/// Kills a request's context when dropped, unless disarmed after a normal end.
struct KillOnDrop(Option<RequestContext>);

impl KillOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(context) = self.0.take() {
            context.kill();
        }
    }
}

pub(crate) fn engine_error(e: EngineError) -> WireError {
    let code = match e {
        EngineError::Unsupported { .. } => WireErrorCode::Unsupported,
        EngineError::Unavailable { .. } => WireErrorCode::EngineUnavailable,
        EngineError::Unreachable { .. } => WireErrorCode::EngineUnreachable,
        EngineError::Timeout { .. } => WireErrorCode::EngineTimeout,
        _ => WireErrorCode::Engine,
    };
    WireError {
        code,
        message: e.to_string(),
    }
}

fn no_kv_events() -> WireError {
    WireError {
        code: WireErrorCode::Unsupported,
        message: "this worker publishes no KV events".to_owned(),
    }
}

async fn send_error(
    tx: &mpsc::Sender<Bytes>,
    stream: u64,
    code: WireErrorCode,
    message: String,
    max: usize,
) {
    if let Ok(f) = frame::encode(Kind::Error, stream, &WireError { code, message }, max) {
        let _ = tx.send(f).await;
    }
}

async fn send_reply<T: serde::Serialize>(
    tx: &mpsc::Sender<Bytes>,
    stream: u64,
    reply: Result<T, WireError>,
    max: usize,
) {
    let f = match reply {
        Ok(value) => frame::encode(Kind::Reply, stream, &value, max),
        Err(e) => frame::encode(Kind::Error, stream, &e, max),
    };
    match f {
        Ok(f) => {
            let _ = tx.send(f).await;
        }
        Err(e) => send_error(tx, stream, WireErrorCode::TooLarge, e.to_string(), max).await,
    }
}

/// Writes queued frames, flushing only when the queue is momentarily empty so that many small
/// frames share one syscall.
pub(crate) async fn write_loop<W>(
    mut sink: FramedWrite<W, tokio_util::codec::LengthDelimitedCodec>,
    mut rx: mpsc::Receiver<Bytes>,
) where
    W: tokio::io::AsyncWrite + Unpin,
{
    while let Some(f) = rx.recv().await {
        if sink.feed(f).await.is_err() {
            return;
        }
        while let Ok(f) = rx.try_recv() {
            if sink.feed(f).await.is_err() {
                return;
            }
        }
        if SinkExt::<Bytes>::flush(&mut sink).await.is_err() {
            return;
        }
    }
    let _ = SinkExt::<Bytes>::close(&mut sink).await;
}
