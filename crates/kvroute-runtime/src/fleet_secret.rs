//! Fleet membership: a secret shared by the routers and workers of one fleet, proven in the
//! request plane's handshake without ever being sent.
//!
//! Each side of a connection sends a fresh 16-byte random nonce (the client in its hello, the
//! worker in its acknowledgement). The worker proves it holds the secret with
//! `HMAC-SHA256(secret, "kvroute-fleet worker" ‖ client nonce ‖ worker nonce)`; the client answers
//! with `HMAC-SHA256(secret, "kvroute-fleet client" ‖ worker nonce ‖ client nonce)` before any
//! request. Proofs are compared in constant time. So a process without the secret can neither
//! serve a router (the router refuses its proof: it never receives a prompt) nor call a worker or
//! register with a router's registry (the worker closes the connection, logging the peer), and a
//! recorded handshake cannot be replayed (the other side's nonce is new every time).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The length of a handshake nonce.
pub(crate) const NONCE_LEN: usize = 16;

/// The length of a proof (an HMAC-SHA256).
pub(crate) const PROOF_LEN: usize = 32;

/// The shortest secret accepted, in bytes.
pub const MIN_FLEET_SECRET_BYTES: usize = 16;

/// Why a fleet secret file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetSecretError {
    /// The file could not be read.
    #[error("cannot read the fleet secret file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The secret is too short to resist guessing.
    #[error(
        "the fleet secret in {path} is {len} bytes; expected at least {MIN_FLEET_SECRET_BYTES} \
         (for example `head -c 32 /dev/urandom | base64 > {path}`)"
    )]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its length after trimming.
        len: usize,
    },
}

/// A fleet's shared secret. Cheap to clone; its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct FleetSecret(Arc<[u8]>);

impl std::fmt::Debug for FleetSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetSecret(***)")
    }
}

/// Which side proves: the worker (server) or the client.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Side {
    Worker,
    Client,
}

impl FleetSecret {
    /// The secret `bytes` (at least [`MIN_FLEET_SECRET_BYTES`]; shorter is refused).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, FleetSecretError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_FLEET_SECRET_BYTES {
            return Err(FleetSecretError::TooShort {
                path: PathBuf::from("(given)"),
                len: bytes.len(),
            });
        }
        Ok(Self(bytes.into()))
    }

    /// Reads the secret from `path`: the whole file, surrounding whitespace trimmed.
    pub fn from_file(path: &Path) -> Result<Self, FleetSecretError> {
        let bytes = std::fs::read(path).map_err(|source| FleetSecretError::Read {
            path: path.to_owned(),
            source,
        })?;
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_FLEET_SECRET_BYTES {
            return Err(FleetSecretError::TooShort {
                path: path.to_owned(),
                len: trimmed.len(),
            });
        }
        Ok(Self(trimmed.into()))
    }

    fn mac(&self, side: Side, first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(match side {
            Side::Worker => b"kvroute-fleet worker",
            Side::Client => b"kvroute-fleet client",
        });
        mac.update(first);
        mac.update(second);
        mac
    }

    /// `side`'s proof over its peer's nonce then its own.
    pub(crate) fn prove(
        &self,
        side: Side,
        peer_nonce: &[u8; NONCE_LEN],
        own_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.mac(side, peer_nonce, own_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is `side`'s proof over `peer_nonce` (the verifier's own nonce) then
    /// `own_nonce` (the prover's); compared in constant time.
    pub(crate) fn verify(
        &self,
        side: Side,
        peer_nonce: &[u8; NONCE_LEN],
        own_nonce: &[u8; NONCE_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(side, peer_nonce, own_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

/// A fresh random nonce.
pub(crate) fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> FleetSecret {
        FleetSecret::new(s.as_bytes()).unwrap()
    }

    #[test]
    fn a_proof_verifies_only_with_the_same_secret_side_and_nonces() {
        let (a, b) = (
            secret("0123456789abcdef-fleet"),
            secret("0123456789abcdef-other"),
        );
        let (client, worker) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let proof = a.prove(Side::Worker, &client, &worker);
        assert!(a.verify(Side::Worker, &client, &worker, &proof));
        assert!(
            !b.verify(Side::Worker, &client, &worker, &proof),
            "another secret"
        );
        assert!(
            !a.verify(Side::Client, &client, &worker, &proof),
            "the other side's proof"
        );
        assert!(
            !a.verify(Side::Worker, &worker, &client, &proof),
            "nonces swapped"
        );
        assert!(
            !a.verify(Side::Worker, &[3; NONCE_LEN], &worker, &proof),
            "a replay"
        );
        assert!(!a.verify(Side::Worker, &client, &worker, &proof[..31]));
    }

    #[test]
    fn short_or_missing_secrets_are_refused_and_the_secret_is_never_shown() {
        assert!(FleetSecret::new(&b"short"[..]).is_err());
        let dir = std::env::temp_dir().join(format!("kvroute-fleet-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, "  tiny\n").unwrap();
        let err = FleetSecret::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("is 4 bytes") && !err.contains("tiny"), "{err}");
        std::fs::write(&path, "a-long-enough-fleet-secret\n").unwrap();
        let s = FleetSecret::from_file(&path).unwrap();
        assert_eq!(s, secret("a-long-enough-fleet-secret"), "trimmed");
        assert_eq!(format!("{s:?}"), "FleetSecret(***)");
        let err = FleetSecret::from_file(&dir.join("absent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot read the fleet secret file"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
