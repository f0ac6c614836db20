//! The shared connection: [`Nats`], its configuration and its observable state.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream;

/// The default namespace of subjects, streams and buckets.
pub const DEFAULT_NAMESPACE: &str = "kvroute";

/// How to reach NATS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConfig {
    /// The server, `nats://HOST:PORT` (or `HOST:PORT`).
    pub url: String,
    /// Prefix of every subject, stream and bucket name (letters, digits, `-` and `_`), so that
    /// several fleets can share one server.
    pub namespace: String,
    /// How long the first connection attempt may take.
    pub connect_timeout: Duration,
    /// The connection name the server shows (`kvroute-serve`, `kvroute-worker-7`, ...).
    pub client_name: String,
    /// A credentials file (a user JWT and its nkey seed, as `nsc` writes them).
    pub creds_file: Option<PathBuf>,
    /// A file holding an nkey user seed (`SU...`), for a server that lists the user's public key.
    pub nkey_file: Option<PathBuf>,
    /// A PEM file of the CA certificates to trust; TLS is then required.
    pub tls_ca: Option<PathBuf>,
}

impl NatsConfig {
    /// Defaults for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            namespace: DEFAULT_NAMESPACE.to_owned(),
            connect_timeout: Duration::from_secs(5),
            client_name: "kvroute".to_owned(),
            creds_file: None,
            nkey_file: None,
            tls_ca: None,
        }
    }

    /// The URL with any password or token in it replaced by `***`: what logs and errors show.
    pub fn display_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The same configuration with `namespace`.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The same configuration with the connection named `name`.
    pub fn with_client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = name.into();
        self
    }
}

/// Why connecting failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The namespace is not a valid NATS name token.
    #[error(
        "invalid NATS namespace {namespace:?}: expected letters, digits, '-' or '_' (at least one)"
    )]
    InvalidNamespace {
        /// The namespace as given.
        namespace: String,
    },
    /// The URL is not a NATS server address (retrying cannot help).
    #[error("invalid NATS URL {url:?}: {message} (expected nats://HOST:PORT)")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        message: String,
    },
    /// The server refused the credentials (or sent none when it needs them); retrying cannot
    /// help.
    #[error(
        "NATS at {url} refused the connection: {message} (check the user and password or token \
         in the URL, --nats-creds or --nats-nkey)"
    )]
    Refused {
        /// The URL tried (without its password).
        url: String,
        /// What the server or the client said.
        message: String,
    },
    /// A credentials, nkey or CA file could not be used.
    #[error("cannot use {what} {path}: {message}")]
    Credentials {
        /// Which file (`the NATS credentials file`, ...).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// TLS could not be set up with the server (its certificate is not trusted, or it does not
    /// speak TLS).
    #[error(
        "TLS with NATS at {url} failed: {message} (check --nats-tls-ca and the server's certificate)"
    )]
    Tls {
        /// The URL tried (without its password).
        url: String,
        /// What the client said.
        message: String,
    },
    /// The server did not answer.
    #[error(
        "cannot connect to NATS at {url}: {message} (is `nats-server -js` running there? \
         JetStream must be enabled)"
    )]
    Unreachable {
        /// The URL tried.
        url: String,
        /// What the client said.
        message: String,
    },
    /// The server refused to create a stream or bucket.
    #[error(
        "NATS refused to set up {what}: {message} (JetStream must be enabled: `nats-server -js`)"
    )]
    Setup {
        /// The stream or bucket.
        what: String,
        /// What the server said.
        message: String,
    },
}

/// The connection's state, for logs and metrics. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct NatsStatus {
    inner: Arc<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    connected: AtomicBool,
    disconnects: AtomicU64,
    reconnects: AtomicU64,
}

impl NatsStatus {
    /// Whether the connection is up now.
    pub fn connected(&self) -> bool {
        self.inner.connected.load(Ordering::Relaxed)
    }

    /// How many times the connection was lost.
    pub fn disconnects(&self) -> u64 {
        self.inner.disconnects.load(Ordering::Relaxed)
    }

    /// How many times it came back after a loss.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::Relaxed)
    }

    /// OpenMetrics families for the connection (no `# EOF`): `kvroute_nats_connected`,
    /// `kvroute_nats_disconnects_total`, `kvroute_nats_reconnects_total`.
    pub fn metrics_text(&self) -> String {
        format!(
            "# HELP kvroute_nats_connected Whether the NATS connection is up (1) or down (0); \
             while down the router routes on its local state.\n\
             # TYPE kvroute_nats_connected gauge\n\
             kvroute_nats_connected {}\n\
             # HELP kvroute_nats_disconnects Times the NATS connection was lost.\n\
             # TYPE kvroute_nats_disconnects counter\n\
             kvroute_nats_disconnects_total {}\n\
             # HELP kvroute_nats_reconnects Times the NATS connection came back.\n\
             # TYPE kvroute_nats_reconnects counter\n\
             kvroute_nats_reconnects_total {}\n",
            u8::from(self.connected()),
            self.disconnects(),
            self.reconnects()
        )
    }

    fn on_event(&self, event: &async_nats::Event) {
        match event {
            async_nats::Event::Connected => {
                if !self.inner.connected.swap(true, Ordering::Relaxed) && self.disconnects() > 0 {
                    self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("NATS connection is back; resuming shared state");
                }
            }
            async_nats::Event::Disconnected => {
                if self.inner.connected.swap(false, Ordering::Relaxed) {
                    self.inner.disconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("NATS connection lost; routing on local state until it returns");
                }
            }
            other => tracing::debug!(event = %other, "NATS event"),
        }
    }
}

/// A connection to NATS with JetStream, shared by the event plane, discovery and the affinity
/// store. Cheap to clone. The client reconnects by itself for as long as the process runs.
#[derive(Debug, Clone)]
pub struct Nats {
    pub(crate) client: async_nats::Client,
    pub(crate) jetstream: jetstream::Context,
    pub(crate) namespace: Arc<str>,
    status: NatsStatus,
}

impl Nats {
    /// Connects to `config.url`; fails when the server does not answer within
    /// `config.connect_timeout` ([`ConnectError::Unreachable`], worth retrying) or at once when
    /// the URL is not a NATS address ([`ConnectError::InvalidUrl`]).
    pub async fn connect(config: &NatsConfig) -> Result<Self, ConnectError> {
        if !is_name_token(&config.namespace) {
            return Err(ConnectError::InvalidNamespace {
                namespace: config.namespace.clone(),
            });
        }
        if let Err(e) = config.url.parse::<async_nats::ServerAddr>() {
            return Err(ConnectError::InvalidUrl {
                url: config.display_url(),
                message: e.to_string(),
            });
        }
        let status = NatsStatus::default();
        let callback_status = status.clone();
        let shown = config.display_url();
        let unreachable = |message: String| ConnectError::Unreachable {
            url: shown.clone(),
            message,
        };
        let (server, options) = authenticate(config).await?;
        let connect = options
            .name(&config.client_name)
            .connection_timeout(config.connect_timeout)
            .event_callback(move |event| {
                let status = callback_status.clone();
                async move { status.on_event(&event) }
            })
            .connect(server);
        let client = tokio::time::timeout(config.connect_timeout, connect)
            .await
            .map_err(|_| unreachable(format!("no answer within {:?}", config.connect_timeout)))?
            .map_err(|e| match e.kind() {
                async_nats::ConnectErrorKind::AuthorizationViolation
                | async_nats::ConnectErrorKind::Authentication => ConnectError::Refused {
                    url: shown.clone(),
                    message: e.to_string(),
                },
                async_nats::ConnectErrorKind::Tls => ConnectError::Tls {
                    url: shown.clone(),
                    message: e.to_string(),
                },
                // A certificate the client does not trust surfaces as an I/O error of the TLS
                // stream; waiting cannot fix it.
                async_nats::ConnectErrorKind::Io if e.to_string().contains("certificate") => {
                    ConnectError::Tls {
                        url: shown.clone(),
                        message: e.to_string(),
                    }
                }
                _ => unreachable(e.to_string()),
            })?;
        status.inner.connected.store(true, Ordering::Relaxed);
        let jetstream = jetstream::new(client.clone());
        Ok(Self {
            client,
            jetstream,
            namespace: config.namespace.as_str().into(),
            status,
        })
    }

    /// The connection's state.
    pub fn status(&self) -> &NatsStatus {
        &self.status
    }

    /// The namespace every name is scoped by.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The KV bucket `bucket` (one value per key) whose entries the server drops `max_age`
    /// after their last write, created if missing. The bucket's stream is created directly, as
    /// the client's own bucket creation would (`KV_<bucket>`, `$KV.<bucket>.>`), because that
    /// first queries the account, which the client cannot parse from a NATS 2.9 server.
    pub(crate) async fn key_value(
        &self,
        bucket: &str,
        max_age: Duration,
    ) -> Result<jetstream::kv::Store, String> {
        let config = jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age,
            storage: jetstream::stream::StorageType::File,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            num_replicas: 1,
            ..Default::default()
        };
        // Two processes started together may both find no stream and both create it; the one
        // that loses (with another `max_age`, "already in use with a different configuration")
        // finds it on a second look.
        if self
            .jetstream
            .get_or_create_stream(config.clone())
            .await
            .is_err()
        {
            self.jetstream
                .get_or_create_stream(config)
                .await
                .map_err(|e| e.to_string())?;
        }
        self.jetstream
            .get_key_value(bucket)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends everything buffered and waits for the server to have it.
    pub async fn flush(&self) -> Result<(), String> {
        self.client.flush().await.map_err(|e| e.to_string())
    }
}

/// The server address without credentials, and the client options carrying them: a user and
/// password (`nats://USER:PASS@HOST:PORT`) or a token (`nats://TOKEN@HOST:PORT`) from the URL
/// (percent-decoded), a credentials file, an nkey seed file, and a CA to trust (TLS required).
async fn authenticate(
    config: &NatsConfig,
) -> Result<(async_nats::ServerAddr, async_nats::ConnectOptions), ConnectError> {
    let invalid = |message: String| ConnectError::InvalidUrl {
        url: config.display_url(),
        message,
    };
    let mut url = url::Url::parse(&with_scheme(&config.url)).map_err(|e| invalid(e.to_string()))?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let user = (!url.username().is_empty()).then(|| decode(url.username()));
    let pass = url.password().map(decode);
    let mut options = async_nats::ConnectOptions::new();
    match (user, pass) {
        (Some(user), Some(pass)) => options = options.user_and_password(user, pass),
        (Some(token), None) => options = options.token(token),
        _ => {}
    }
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let server = url
        .as_str()
        .parse::<async_nats::ServerAddr>()
        .map_err(|e| invalid(e.to_string()))?;
    let file_error = |what: &'static str, path: &Path| {
        let path = path.to_owned();
        move |e: std::io::Error| ConnectError::Credentials {
            what,
            path,
            message: e.to_string(),
        }
    };
    if let Some(path) = &config.creds_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(file_error("the NATS credentials file", path))?;
    }
    if let Some(path) = &config.nkey_file {
        let seed =
            std::fs::read_to_string(path).map_err(file_error("the NATS nkey seed file", path))?;
        let seed = seed
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("SU"))
            .ok_or_else(|| ConnectError::Credentials {
                what: "the NATS nkey seed file",
                path: path.clone(),
                message: "no user seed in it (a line starting with SU)".to_owned(),
            })?;
        options = options.nkey(seed.to_owned());
    }
    if let Some(path) = &config.tls_ca {
        if let Err(e) = std::fs::metadata(path) {
            return Err(file_error("the NATS CA file", path)(e));
        }
        options = options
            .add_root_certificates(path.clone())
            .require_tls(true);
    }
    Ok((server, options))
}

/// `url` with `nats://` in front when it names no scheme (`HOST:PORT`).
fn with_scheme(url: &str) -> String {
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("nats://{url}")
    }
}

/// `url` with its password (or its token, a user name without a password) replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => url.to_owned(),
        };
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => format!("{scheme}://***@{host}"),
        },
        None => url.to_owned(),
    }
}

/// Whether `s` is a valid token of a NATS name (stream, bucket, subject token).
pub(crate) fn is_name_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_and_tokens_never_reach_a_displayed_url() {
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_url("nats://alice:s3cr%40t@host:4222"),
            "nats://alice:***@host:4222"
        );
        assert_eq!(redact_url("tls://tok3n@host:4222"), "tls://***@host:4222");
        assert_eq!(redact_url("tok3n@host:4222"), "***@host:4222");
        let config = NatsConfig::new("nats://a:b@h:1");
        assert_eq!(config.display_url(), "nats://a:***@h:1");
    }

    #[test]
    fn namespaces_are_single_name_tokens() {
        assert!(is_name_token("kvroute"));
        assert!(is_name_token("fleet-a_2"));
        assert!(!is_name_token(""));
        assert!(!is_name_token("a.b"));
        assert!(!is_name_token("a b"));
        assert!(!is_name_token("a>"));
    }
}
