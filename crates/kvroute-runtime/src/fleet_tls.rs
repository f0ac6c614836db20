//! Mutual TLS on the request plane (rustls): every router and worker holds a certificate signed
//! by the fleet's CA and trusts only that CA, so traffic between them is encrypted and each side
//! knows the other belongs to the fleet. A worker's certificate must name the host or IP address
//! it registers (its `--advertise` address); a router's certificate is checked against the CA
//! only. [`FleetTls::reload`] re-reads the files (`kvroute serve` and `kvroute worker` do it on
//! SIGHUP): new connections use them, established ones keep theirs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// Why the fleet's TLS files could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetTlsError {
    /// A file could not be read or holds no usable PEM object.
    #[error("cannot use {what} {path}: {message}")]
    File {
        /// Which file (`the fleet CA`, ...).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// rustls refused the configuration.
    #[error("fleet TLS configuration: {0}")]
    Config(String),
}

/// The fleet's TLS: the CA every side trusts and this process's own certificate and key. Cheap to
/// clone. Its `Debug` names the files, never the key.
#[derive(Clone)]
pub struct FleetTls {
    inner: Arc<Inner>,
}

struct Inner {
    files: [PathBuf; 3],
    configs: RwLock<Configs>,
}

#[derive(Clone)]
struct Configs {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for FleetTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetTls")
            .field("ca", &self.inner.files[0])
            .field("cert", &self.inner.files[1])
            .finish_non_exhaustive()
    }
}

/// The read half of a request-plane connection: plain TCP or TLS over it.
pub(crate) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;

/// The write half of a request-plane connection.
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// The halves of a plain TCP connection (split without a lock).
pub(crate) fn plain(tcp: TcpStream) -> (ReadHalf, WriteHalf) {
    let (read, write) = tcp.into_split();
    (Box::new(read), Box::new(write))
}

fn halves<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(stream: S) -> (ReadHalf, WriteHalf) {
    let (read, write) = tokio::io::split(stream);
    (Box::new(read), Box::new(write))
}

impl FleetTls {
    /// Reads the fleet CA (`ca`, PEM certificates), this process's certificate chain (`cert`,
    /// PEM, leaf first) and its private key (`key`, PEM).
    pub fn load(
        ca: impl Into<PathBuf>,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Result<Self, FleetTlsError> {
        let files = [ca.into(), cert.into(), key.into()];
        let configs = build(&files)?;
        Ok(Self {
            inner: Arc::new(Inner {
                files,
                configs: RwLock::new(configs),
            }),
        })
    }

    /// Re-reads the three files; new connections use them from now on. On failure the
    /// configuration in use is kept.
    pub fn reload(&self) -> Result<(), FleetTlsError> {
        let fresh = build(&self.inner.files)?;
        *self.inner.configs.write() = fresh;
        Ok(())
    }

    fn configs(&self) -> Configs {
        self.inner.configs.read().clone()
    }
}

fn build(files: &[PathBuf; 3]) -> Result<Configs, FleetTlsError> {
    {
        let [ca, cert, key] = files;
        let file = |what: &'static str, path: &Path| {
            let path = path.to_owned();
            move |message: String| FleetTlsError::File {
                what,
                path,
                message,
            }
        };
        let certs = |what: &'static str,
                     path: &Path|
         -> Result<Vec<CertificateDer<'static>>, FleetTlsError> {
            let found = CertificateDer::pem_file_iter(path)
                .map_err(|e| file(what, path)(e.to_string()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| file(what, path)(e.to_string()))?;
            if found.is_empty() {
                return Err(file(what, path)("no PEM certificate in it".to_owned()));
            }
            Ok(found)
        };
        let mut roots = RootCertStore::empty();
        for c in certs("the fleet CA", ca)? {
            roots
                .add(c)
                .map_err(|e| file("the fleet CA", ca)(e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let chain = certs("the fleet certificate", cert)?;
        let private = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| file("the fleet key", key)(e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = |e: rustls::Error| FleetTlsError::Config(e.to_string());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| FleetTlsError::Config(e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(config)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), private.clone_key())
            .map_err(|e| file("the fleet key", key)(e.to_string()))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(config)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, private)
            .map_err(|e| file("the fleet key", key)(e.to_string()))?;
        Ok(Configs {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

impl FleetTls {
    /// The server side of a new connection.
    pub(crate) async fn accept(&self, tcp: TcpStream) -> std::io::Result<(ReadHalf, WriteHalf)> {
        let stream = tokio_rustls::TlsAcceptor::from(self.configs().server)
            .accept(tcp)
            .await?;
        Ok(halves(stream))
    }

    /// The client side of a connection to `addr` (`host:port`): the worker's certificate must
    /// name `host`.
    pub(crate) async fn connect(
        &self,
        addr: &str,
        tcp: TcpStream,
    ) -> std::io::Result<(ReadHalf, WriteHalf)> {
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(host, _)| host)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let stream = tokio_rustls::TlsConnector::from(self.configs().client)
            .connect(name, tcp)
            .await?;
        Ok(halves(stream))
    }
}
