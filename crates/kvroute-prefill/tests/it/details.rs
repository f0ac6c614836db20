//! The prefill worker's prompt token details reach the decode stream on both paths, with
//! scripted in-memory phase streams, so that the order in which the prefill and the decode
//! finish is the test's to choose.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc;
use futures::future::BoxFuture;
use kvroute_prefill::{
    DisaggMode, PhaseRouteError, PhaseRouter, PhaseStream, PrefillRouter, PrefillRouterConfig,
    Routed, Served,
};
use kvroute_protocols::{
    Annotated, CompletionUsage, LLMEngineOutput, PreprocessedRequest, PromptTokensDetails,
    RequestPhase, WorkerWithDpRank,
};
use kvroute_runtime::{InstanceInfo, InstanceSet, RequestError, WorkerRole};
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::watch;

use crate::support::bootstrap_meta;

const PREFILL: WorkerWithDpRank = WorkerWithDpRank::new(10, 0);
const DECODE: WorkerWithDpRank = WorkerWithDpRank::new(20, 0);

const DETAILS: PromptTokensDetails = PromptTokensDetails {
    audio_tokens: None,
    cached_tokens: Some(32),
};

type Item = Result<Annotated<LLMEngineOutput>, RequestError>;

/// A `PhaseRouter` that answers each phase with the next stream the test queued for it, on
/// prefill worker 10 or decode worker 20, and records the requests.
#[derive(Default)]
struct ScriptedPhases {
    prefill: Mutex<VecDeque<PhaseStream>>,
    decode: Mutex<VecDeque<PhaseStream>>,
    seen: Mutex<Vec<(RequestPhase, PreprocessedRequest)>>,
}

impl ScriptedPhases {
    fn queue(&self, phase: RequestPhase) -> &Mutex<VecDeque<PhaseStream>> {
        match phase {
            RequestPhase::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }

    fn worker(phase: RequestPhase) -> WorkerWithDpRank {
        match phase {
            RequestPhase::Prefill => PREFILL,
            _ => DECODE,
        }
    }

    fn push(&self, phase: RequestPhase, stream: PhaseStream) {
        self.queue(phase).lock().push_back(stream);
    }

    fn seen(&self, phase: RequestPhase) -> Vec<PreprocessedRequest> {
        let seen = self.seen.lock();
        seen.iter()
            .filter(|(p, _)| *p == phase)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

impl PhaseRouter for ScriptedPhases {
    fn route<'a>(
        &'a self,
        _request_id: &'a str,
        request: PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<Routed, PhaseRouteError>> {
        Box::pin(async move {
            self.seen.lock().push((phase, request));
            let stream = self
                .queue(phase)
                .lock()
                .pop_front()
                .ok_or(PhaseRouteError::NoWorkers { phase })?;
            Ok(Routed {
                worker: Self::worker(phase),
                stream,
            })
        })
    }

    fn select<'a>(
        &'a self,
        _request: &'a PreprocessedRequest,
        phase: RequestPhase,
    ) -> BoxFuture<'a, Result<WorkerWithDpRank, PhaseRouteError>> {
        Box::pin(async move { Ok(Self::worker(phase)) })
    }
}

/// A prefill router over `phases` with prefill worker 10 registered with `metadata`. The
/// returned sender keeps the discovery snapshot open.
fn router(
    phases: &Arc<ScriptedPhases>,
    metadata: &[(&str, &str)],
) -> (PrefillRouter<ScriptedPhases>, watch::Sender<InstanceSet>) {
    let mut info = InstanceInfo::new(PREFILL.worker_id, "127.0.0.1:1".to_owned(), 16)
        .with_role(WorkerRole::Prefill);
    info.metadata = metadata
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let (tx, rx) = watch::channel(Arc::new(BTreeMap::from([(PREFILL.worker_id, info)])));
    let config = PrefillRouterConfig::default().with_mode(DisaggMode::Enforced);
    (PrefillRouter::new(Arc::clone(phases), rx, config), tx)
}

fn request() -> PreprocessedRequest {
    let mut req = PreprocessedRequest::new("m", (0..40).collect());
    req.stop_conditions.max_tokens = Some(2);
    req
}

/// The prefill worker's one token, with the handover parameters.
fn prefill_token() -> Item {
    Ok(Annotated::from_data(LLMEngineOutput {
        token_ids: vec![7],
        disaggregated_params: Some(json!({"kv": "here"})),
        ..LLMEngineOutput::default()
    }))
}

/// The prefill worker's last item, reporting `details`.
fn prefill_usage(details: PromptTokensDetails) -> Item {
    Ok(Annotated::from_data(LLMEngineOutput {
        completion_usage: Some(CompletionUsage {
            prompt_tokens: 40,
            completion_tokens: 1,
            total_tokens: 41,
            prompt_tokens_details: Some(details),
        }),
        ..LLMEngineOutput::length()
    }))
}

/// A decode worker's output: two tokens and the end, at once.
fn decode_output() -> PhaseStream {
    let items: Vec<Item> = vec![
        Ok(Annotated::from_data(LLMEngineOutput {
            token_ids: vec![100, 101],
            ..LLMEngineOutput::default()
        })),
        Ok(Annotated::from_data(LLMEngineOutput::length())),
    ];
    Box::pin(futures::stream::iter(items))
}

#[tokio::test]
async fn the_prefill_results_details_are_the_streams_before_decode_streams() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &[]);
    let prefill: Vec<Item> = vec![prefill_token(), prefill_usage(DETAILS)];
    phases.push(
        RequestPhase::Prefill,
        Box::pin(futures::stream::iter(prefill)),
    );
    phases.push(RequestPhase::Decode, decode_output());
    let mut stream = router.generate("r", request()).await.expect("served");
    assert_eq!(stream.served(), &Served::PrefillResult { prefill: PREFILL });
    assert_eq!(stream.prefill_tokens_details(), Some(DETAILS));
    // The decode worker got them too, in the prefill result (a decode worker like Dynamo's
    // reports them as its own).
    let decode = phases.seen(RequestPhase::Decode).pop().expect("decoded");
    let result = decode.prefill_result.expect("the prefill result");
    assert_eq!(result.prompt_tokens_details, Some(DETAILS));
    while stream.next().await.is_some() {}
    assert_eq!(stream.prefill_tokens_details(), Some(DETAILS));
}

#[tokio::test]
async fn a_background_prefill_finishing_after_the_decode_still_hands_its_details_over() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7300"));
    let (prefill_tx, prefill_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Prefill, Box::pin(prefill_rx));
    phases.push(RequestPhase::Decode, decode_output());
    let mut stream = router.generate("r", request()).await.expect("served");
    assert!(
        matches!(stream.served(), Served::Bootstrap { prefill, .. } if *prefill == PREFILL),
        "{:?}",
        stream.served()
    );
    prefill_tx.unbounded_send(prefill_token()).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let item = stream.next().await.expect("a decode item");
        tokens.extend(item.data.map(|d| d.token_ids).unwrap_or_default());
    }
    assert_eq!(tokens, vec![100, 101]);
    // The decode output is over but the prefill is not: the stream waits for it rather than
    // end without its details.
    assert!(futures::poll!(stream.next()).is_pending());
    assert_eq!(stream.prefill_tokens_details(), None);
    prefill_tx.unbounded_send(prefill_usage(DETAILS)).unwrap();
    drop(prefill_tx);
    assert!(
        stream.next().await.is_none(),
        "the stream ends with the prefill"
    );
    assert_eq!(stream.prefill_tokens_details(), Some(DETAILS));
}

#[tokio::test(start_paused = true)]
async fn a_prefill_silent_past_the_grace_does_not_hold_the_response_up() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7302"));
    let (prefill_tx, prefill_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Prefill, Box::pin(prefill_rx));
    phases.push(RequestPhase::Decode, decode_output());
    let mut stream = router.generate("r", request()).await.expect("served");
    assert!(matches!(stream.served(), Served::Bootstrap { .. }));
    // The prefill hands its KV over (its first token) and then never finishes.
    prefill_tx.unbounded_send(prefill_token()).unwrap();
    for _ in 0..2 {
        stream.next().await.expect("a decode item");
    }
    let waited = tokio::time::Instant::now();
    assert!(futures::poll!(stream.next()).is_pending());
    assert!(
        stream.next().await.is_none(),
        "the stream ends after the grace"
    );
    assert_eq!(waited.elapsed(), kvroute_prefill::PREFILL_DETAILS_GRACE);
    assert_eq!(stream.prefill_tokens_details(), None);
    // The prefill was detached, not cancelled: its worker may still finish it.
    assert!(
        !prefill_tx.is_closed(),
        "the background prefill is still reading"
    );
}

#[tokio::test]
async fn a_failed_background_prefill_leaves_no_details_and_the_stream_ends() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7301"));
    // The prefill worker reports usage, but its answer has no handover parameters: failed.
    let prefill: Vec<Item> = vec![prefill_usage(DETAILS)];
    phases.push(
        RequestPhase::Prefill,
        Box::pin(futures::stream::iter(prefill)),
    );
    phases.push(RequestPhase::Decode, decode_output());
    let mut stream = router.generate("r", request()).await.expect("served");
    assert!(matches!(stream.served(), Served::Bootstrap { .. }));
    while stream.next().await.is_some() {}
    assert_eq!(stream.prefill_tokens_details(), None);
}

#[tokio::test]
async fn a_bootstrap_prefill_that_fails_fails_its_waiting_decode_and_cancels_it() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7302"));
    let prefill: Vec<Item> = vec![Ok(Annotated::from_error("prefill engine out of memory"))];
    phases.push(
        RequestPhase::Prefill,
        Box::pin(futures::stream::iter(prefill)),
    );
    // The decode worker waits for KV that never comes: its stream stays open.
    let (decode_tx, decode_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Decode, Box::pin(decode_rx));
    let mut stream = router.generate("r", request()).await.expect("served");
    assert!(matches!(stream.served(), Served::Bootstrap { .. }));
    let item = stream.next().await.expect("an error item");
    let message = item.error_message().expect("an error").to_owned();
    assert!(
        message.contains("prefill engine out of memory") && message.contains("prefill worker"),
        "{message}"
    );
    assert!(stream.next().await.is_none(), "the pair ends together");
    assert!(
        decode_tx.is_closed(),
        "the decode half was dropped, which cancels it on its worker"
    );
}

#[tokio::test]
async fn a_bootstrap_prefill_failing_after_the_kv_arrived_leaves_decode_running() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7303"));
    let (prefill_tx, prefill_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Prefill, Box::pin(prefill_rx));
    let (decode_tx, decode_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Decode, Box::pin(decode_rx));
    let mut stream = router.generate("r", request()).await.expect("served");
    decode_tx
        .unbounded_send(Ok(Annotated::from_data(LLMEngineOutput {
            token_ids: vec![100],
            ..LLMEngineOutput::default()
        })))
        .expect("send");
    let first = stream.next().await.expect("the first token");
    assert_eq!(first.data.expect("data").token_ids, vec![100]);
    // The prefill worker goes wrong now: decoding, which has its KV, carries on.
    prefill_tx
        .unbounded_send(Ok(Annotated::from_error("late failure")))
        .expect("send");
    drop(prefill_tx);
    decode_tx
        .unbounded_send(Ok(Annotated::from_data(LLMEngineOutput::length())))
        .expect("send");
    drop(decode_tx);
    let rest: Vec<_> = stream.collect().await;
    assert!(rest.iter().all(|i| !i.is_error()), "{rest:?}");
    assert_eq!(rest.len(), 1);
}

#[tokio::test]
async fn a_decode_that_fails_takes_its_background_prefill_down_with_it() {
    let phases = Arc::new(ScriptedPhases::default());
    let (router, _discovery) = router(&phases, &bootstrap_meta("7304"));
    // The prefill worker is still computing: its stream stays open.
    let (prefill_tx, prefill_rx) = mpsc::unbounded::<Item>();
    phases.push(RequestPhase::Prefill, Box::pin(prefill_rx));
    let lost = RequestError::WorkerUnavailable {
        addr: "127.0.0.1:1".into(),
        reason: "connection reset".into(),
    };
    let decode: Vec<Item> = vec![Err(lost)];
    phases.push(
        RequestPhase::Decode,
        Box::pin(futures::stream::iter(decode)),
    );
    let mut stream = router.generate("r", request()).await.expect("served");
    let failure = stream.next().await.expect("the decode failure");
    assert!(failure.is_error(), "{failure:?}");
    // The client side gives up (or the router migrates): dropping the pair cancels the prefill.
    drop(stream);
    for _ in 0..500 {
        if prefill_tx.is_closed() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the background prefill outlived its failed decode");
}
