//! Client authentication: API keys from a file, checked on every `/v1/*` request.
//!
//! A client sends `Authorization: Bearer KEY` (what the OpenAI SDKs send with `api_key=`). The
//! key is compared in constant time with every configured key ([`subtle`]), so the time taken
//! does not tell an attacker how much of a guess was right. A missing or wrong key gets 401 in
//! OpenAI's error shape (`code: invalid_api_key`) and is counted by outcome in `/metrics`
//! (`kvroute_router_http_auth_total{outcome}`); the key itself is never logged, echoed or
//! counted. `/health`, `/live` and `/metrics` stay open (probes and scrapers carry no key; they
//! reveal no prompt). The key file is re-read on demand ([`ApiKeys::reload`]; `kvroute serve`
//! does it on SIGHUP), so keys rotate without a restart; a reload that fails keeps the old keys.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use parking_lot::RwLock;
use subtle::ConstantTimeEq;

use super::error::ApiError;
use crate::push::KvPushRouter;

/// Why a key file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiKeyError {
    /// The file could not be read.
    #[error("cannot read the API key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no key (a router that accepts no key would refuse everyone).
    #[error(
        "the API key file {path} holds no key: expected one key per line (blank lines and lines \
         starting with # are skipped)"
    )]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A line holds something that cannot be sent in an `Authorization` header.
    #[error(
        "the API key file {path}, line {line}: a key must be printable ASCII without spaces \
         (it is sent as `Authorization: Bearer KEY`)"
    )]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The 1-based line number (the key itself is not repeated).
        line: usize,
    },
}

/// The accepted client keys, read from a file and re-read on [`Self::reload`]. Cheap to clone
/// (clones share the keys). Its `Debug` shows how many keys there are, never the keys.
#[derive(Clone)]
pub struct ApiKeys {
    path: PathBuf,
    keys: Arc<RwLock<Arc<Vec<Vec<u8>>>>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("path", &self.path)
            .field("keys", &self.len())
            .finish()
    }
}

impl ApiKeys {
    /// Reads the keys in `path`: one per line, surrounding whitespace trimmed, blank lines and
    /// lines starting with `#` skipped. Fails when the file cannot be read, holds no key, or a
    /// key could not be sent in a header.
    pub fn load(path: impl Into<PathBuf>) -> Result<Self, ApiKeyError> {
        let path = path.into();
        let keys = read_keys(&path)?;
        Ok(Self {
            path,
            keys: Arc::new(RwLock::new(Arc::new(keys))),
        })
    }

    /// Re-reads the file; on success the new keys apply to every request from now on and their
    /// number is returned. On failure the keys in use are kept.
    pub fn reload(&self) -> Result<usize, ApiKeyError> {
        let keys = read_keys(&self.path)?;
        let n = keys.len();
        *self.keys.write() = Arc::new(keys);
        Ok(n)
    }

    /// The file the keys come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many keys are accepted.
    pub fn len(&self) -> usize {
        self.keys.read().len()
    }

    /// Always false once loaded (a file without keys is refused); here for completeness.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `presented` is one of the keys. Every key is compared, each in constant time.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let keys = self.keys.read().clone();
        keys.iter()
            .fold(subtle::Choice::from(0), |found, key| {
                found | key.as_slice().ct_eq(presented)
            })
            .into()
    }
}

fn read_keys(path: &Path) -> Result<Vec<Vec<u8>>, ApiKeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| ApiKeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let key = line.trim();
        if key.is_empty() || key.starts_with('#') {
            continue;
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiKeyError::Invalid {
                path: path.to_owned(),
                line: i + 1,
            });
        }
        keys.push(key.as_bytes().to_vec());
    }
    if keys.is_empty() {
        return Err(ApiKeyError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(keys)
}

/// How a request's key was judged, as counted in `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuthOutcome {
    /// A configured key.
    Ok,
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key that is not configured.
    Invalid,
}

impl AuthOutcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Missing => "missing",
            Self::Invalid => "invalid",
        }
    }
}

/// The bearer token of `Authorization` (scheme case-insensitive), if any.
fn bearer(request: &Request) -> Option<&[u8]> {
    let value = request.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
}

/// What [`require_key`] needs: the keys (none: authentication is off), and the router whose
/// metrics count the outcomes.
#[derive(Clone)]
pub(crate) struct KeyCheck {
    keys: Option<ApiKeys>,
    router: KvPushRouter,
}

impl KeyCheck {
    /// Checks `keys` (if any), counting outcomes in `router`'s metrics.
    pub(crate) fn new(keys: Option<ApiKeys>, router: KvPushRouter) -> Self {
        Self { keys, router }
    }
}

/// The middleware in front of `/v1/*`: passes requests with a configured key, answers 401
/// otherwise (without reading the body). Without keys configured every request passes.
pub(crate) async fn require_key(
    State(check): State<KeyCheck>,
    request: Request,
    next: Next,
) -> Response {
    let Some(keys) = &check.keys else {
        return next.run(request).await;
    };
    let outcome = match bearer(&request) {
        None => AuthOutcome::Missing,
        Some(key) if keys.accepts(key) => AuthOutcome::Ok,
        Some(_) => AuthOutcome::Invalid,
    };
    check.router.metrics().on_auth(outcome.label());
    match outcome {
        AuthOutcome::Ok => next.run(request).await,
        AuthOutcome::Missing => ApiError::unauthorized(
            "no API key: send it as `Authorization: Bearer KEY` (the OpenAI SDKs' `api_key`)",
        )
        .into_response(),
        AuthOutcome::Invalid => {
            ApiError::unauthorized("the API key sent in `Authorization` is not valid here")
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn keys_are_read_one_per_line_with_comments_and_blanks_skipped() {
        let f = file("# team a\nsk-alpha\n\n  sk-beta  \n#sk-commented\n");
        let keys = ApiKeys::load(f.path()).unwrap();
        assert_eq!(keys.len(), 2);
        assert!(keys.accepts(b"sk-alpha"));
        assert!(keys.accepts(b"sk-beta"));
        assert!(!keys.accepts(b"sk-commented"));
        assert!(!keys.accepts(b"sk-alph"));
        assert!(!keys.accepts(b"sk-alphaa"));
        assert!(!keys.accepts(b""));
        let debug = format!("{keys:?}");
        assert!(
            !debug.contains("sk-alpha") && debug.contains("keys: 2"),
            "{debug}"
        );
    }

    #[test]
    fn a_file_without_keys_or_with_an_unsendable_key_is_refused_without_echoing_it() {
        let empty = file("# nothing yet\n\n");
        let err = ApiKeys::load(empty.path()).unwrap_err();
        assert!(err.to_string().contains("holds no key"), "{err}");
        let spaced = file("sk-ok\nsk bad key\n");
        let err = ApiKeys::load(spaced.path()).unwrap_err().to_string();
        assert!(err.contains("line 2") && !err.contains("bad key"), "{err}");
        let err = ApiKeys::load("/nonexistent/keys").unwrap_err().to_string();
        assert!(
            err.contains("cannot read the API key file /nonexistent/keys"),
            "{err}"
        );
    }

    #[test]
    fn a_reload_swaps_the_keys_and_a_failed_one_keeps_them() {
        let f = file("sk-old\n");
        let keys = ApiKeys::load(f.path()).unwrap();
        let shared = keys.clone();
        std::fs::write(f.path(), "sk-new\nsk-newer\n").unwrap();
        assert_eq!(keys.reload().unwrap(), 2);
        assert!(shared.accepts(b"sk-new") && !shared.accepts(b"sk-old"));
        std::fs::write(f.path(), "").unwrap();
        assert!(keys.reload().is_err());
        assert!(
            shared.accepts(b"sk-newer"),
            "a failed reload keeps the keys in use"
        );
    }
}
