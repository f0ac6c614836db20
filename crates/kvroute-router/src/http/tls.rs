//! TLS for the frontend (rustls): a certificate chain and its private key from PEM files,
//! re-read on demand ([`ServerTls::reload`]; `kvroute serve` does it on SIGHUP), so a renewed
//! certificate takes effect for new connections without a restart. A reload that fails keeps the
//! certificate in use. HTTP/1.1 only (ALPN `http/1.1`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why the certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The certificate file could not be read or holds no PEM certificate.
    #[error("cannot read the TLS certificate {path}: {message} (expected a PEM certificate chain)")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The key file could not be read, holds no PEM private key, or a key rustls cannot use.
    #[error(
        "cannot use the TLS private key {path}: {message} (expected a PEM PKCS#8, PKCS#1 or SEC1 key)"
    )]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The frontend's TLS: the acceptor's configuration over a reloadable certificate. Cheap to
/// clone (clones share the certificate).
#[derive(Clone)]
pub struct ServerTls {
    resolver: Arc<Reloadable>,
    config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.resolver.cert)
            .field("key", &self.resolver.key)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Reloadable {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Reloadable {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().clone())
    }
}

fn load(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let cert_error = |message: String| TlsError::Certificate {
        path: cert.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| cert_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_error(e.to_string()))?;
    if chain.is_empty() {
        return Err(cert_error("no certificate in it".to_owned()));
    }
    let key_error = |message: String| TlsError::Key {
        path: key.to_owned(),
        message,
    };
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| key_error(e.to_string()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&der)
        .map_err(|e| key_error(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| key_error(format!("it does not match the certificate ({e})")))?;
    Ok(Arc::new(certified))
}

impl ServerTls {
    /// Loads the PEM certificate chain `cert` (leaf first) and its private key `key`.
    pub fn load(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Result<Self, TlsError> {
        let (cert, key) = (cert.into(), key.into());
        let current = load(&cert, &key)?;
        let resolver = Arc::new(Reloadable {
            cert,
            key,
            current: RwLock::new(current),
        });
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            resolver,
            config: Arc::new(config),
        })
    }

    /// Re-reads both files; new connections use them from now on. On failure the certificate
    /// in use is kept.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = load(&self.resolver.cert, &self.resolver.key)?;
        *self.resolver.current.write() = fresh;
        Ok(())
    }

    /// The acceptor for new connections.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }
}
