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

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvroute_protocols::WorkerId;
use tokio::sync::watch;

use crate::discovery::{InstanceInfo, InstanceSet, filtered_instances};

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

/// The metadata key under which a registration carries its proof of the fleet secret (hex of
/// an HMAC over its id and address), for discovery backends whose registrations travel outside
/// the request plane (NATS).
pub const FLEET_PROOF_METADATA: &str = "fleet_proof";

impl FleetSecret {
    fn registration_mac(&self, id: WorkerId, address: &str) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(b"kvroute-fleet registration");
        mac.update(&id.to_le_bytes());
        mac.update(address.as_bytes());
        mac
    }

    /// The proof a registration of worker `id` at `address` carries under
    /// [`FLEET_PROOF_METADATA`]: only a holder of the secret can make it, and it is bound to the
    /// address, so a copied proof only ever lists the worker it was made for.
    pub fn registration_proof(&self, id: WorkerId, address: &str) -> String {
        self.registration_mac(id, address)
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `info` carries a valid proof (compared in constant time).
    pub fn verifies_registration(&self, info: &InstanceInfo) -> bool {
        let Some(hex) = info.metadata.get(FLEET_PROOF_METADATA) else {
            return false;
        };
        let bytes: Option<Vec<u8>> = (0..hex.len())
            .step_by(2)
            .map(|i| {
                hex.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect();
        bytes.is_some_and(|bytes| {
            self.registration_mac(info.id, &info.address)
                .verify_slice(&bytes)
                .is_ok()
        })
    }
}

/// The instances of `instances` that prove `secret` in their registration; each one left out is
/// logged once (with its address) while it stays listed. For discovery whose registrations do not
/// pass through a registry that checks the secret itself (NATS).
pub fn membership_filtered(
    instances: watch::Receiver<InstanceSet>,
    secret: FleetSecret,
) -> watch::Receiver<InstanceSet> {
    let mut refused: HashSet<(WorkerId, String)> = HashSet::new();
    filtered_instances(instances, move |set| {
        let mut still_refused = HashSet::new();
        let kept: BTreeMap<WorkerId, InstanceInfo> = set
            .iter()
            .filter(|(id, info)| {
                let ok = secret.verifies_registration(info);
                if !ok {
                    let key = (**id, info.address.clone());
                    if !refused.contains(&key) {
                        tracing::warn!(
                            worker = **id,
                            address = %info.address,
                            "ignoring a registration without a valid proof of the fleet secret"
                        );
                    }
                    still_refused.insert(key);
                }
                ok
            })
            .map(|(id, info)| (*id, info.clone()))
            .collect();
        refused = still_refused;
        Arc::new(kept)
    })
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
    fn a_registration_proof_is_bound_to_the_secret_id_and_address() {
        let (a, b) = (
            secret("0123456789abcdef-fleet"),
            secret("0123456789abcdef-other"),
        );
        let mut info = InstanceInfo::new(7, "10.0.0.7:9000", 16);
        assert!(!a.verifies_registration(&info), "no proof");
        info.metadata.insert(
            FLEET_PROOF_METADATA.to_owned(),
            a.registration_proof(7, "10.0.0.7:9000"),
        );
        assert!(a.verifies_registration(&info));
        assert!(!b.verifies_registration(&info), "another secret");
        let mut moved = info.clone();
        moved.address = "10.0.0.8:9000".to_owned();
        assert!(
            !a.verifies_registration(&moved),
            "a copied proof for another address"
        );
        let mut other = info.clone();
        other.id = 8;
        assert!(
            !a.verifies_registration(&other),
            "a copied proof for another id"
        );
        info.metadata
            .insert(FLEET_PROOF_METADATA.to_owned(), "zz".to_owned());
        assert!(!a.verifies_registration(&info), "garbage");
    }

    #[tokio::test]
    async fn the_membership_filter_lists_only_proven_registrations() {
        let s = secret("0123456789abcdef-fleet");
        let mut proven = InstanceInfo::new(1, "127.0.0.1:1", 16);
        proven.metadata.insert(
            FLEET_PROOF_METADATA.to_owned(),
            s.registration_proof(1, "127.0.0.1:1"),
        );
        let stranger = InstanceInfo::new(2, "127.0.0.1:2", 16);
        let (tx, rx) = watch::channel(InstanceSet::default());
        let mut filtered = membership_filtered(rx, s);
        tx.send_replace(Arc::new(BTreeMap::from([(1, proven), (2, stranger)])));
        filtered.changed().await.unwrap();
        assert_eq!(
            filtered.borrow().keys().copied().collect::<Vec<_>>(),
            vec![1]
        );
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
