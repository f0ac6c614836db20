//! What only `kvroute serve` does on NATS: registering the workers of its own registry there
//! on their behalf. The connection itself is shared with `kvroute worker` ([`crate::cli::nats`]).

use std::time::Duration;

use kvroute_nats::NatsDiscovery;

/// Registers in NATS, on their behalf, the workers that registered with this router's own
/// registry (`--registry-listen` beside `--nats`), for as long as they stay registered here, so
/// every router replica serves them. A registration NATS refuses (another live worker holds the
/// id) is logged and retried every few seconds. The task ends with the registry; dropping it
/// withdraws every registration it made.
pub(crate) fn proxy_registrations(
    mut registry: tokio::sync::watch::Receiver<kvroute_runtime::InstanceSet>,
    discovery: NatsDiscovery,
) -> tokio::task::JoinHandle<()> {
    use kvroute_runtime::Discovery as _;
    tokio::spawn(async move {
        let mut leases = std::collections::BTreeMap::new();
        let mut retry = tokio::time::interval(Duration::from_secs(2));
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let current = registry.borrow_and_update().clone();
            // Withdraw what left or changed (a changed one is registered again below).
            leases.retain(|id, (info, _lease)| current.get(id) == Some(&*info));
            for (id, info) in current.iter() {
                if leases.contains_key(id) {
                    continue;
                }
                match discovery.register(info.clone()).await {
                    Ok(lease) => {
                        tracing::info!(
                            worker = id,
                            "registered in NATS on behalf of a worker registered here"
                        );
                        leases.insert(*id, (info.clone(), lease));
                    }
                    Err(error) => {
                        tracing::warn!(worker = id, %error, "cannot register this worker in NATS yet; retrying");
                    }
                }
            }
            tokio::select! {
                changed = registry.changed() => if changed.is_err() { return },
                _ = retry.tick(), if leases.len() < current.len() => {}
            }
        }
    })
}
