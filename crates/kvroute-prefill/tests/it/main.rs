//! Integration tests of kvroute-prefill: the prefill router over real TCP workers (kvroute-runtime
//! `WorkerServer` on loopback) found through in-process discovery, with small fake prefill and
//! decode engines that follow the disaggregation contract (one token with
//! `disaggregated_params` from prefill; decode fetches the KV from the bootstrap room or takes
//! the prefill result). The same contract is tested against the mocker's prefill role in
//! kvroute-mocker's own tests, since the layering keeps the two crates apart.

mod conditional;
mod details;
mod disagg;
mod support;
