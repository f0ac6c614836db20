//! proptest strategies for every wire type.
//!
//! Floats are dyadic fractions so JSON's decimal text reproduces them exactly, and opaque JSON
//! payloads are objects (a top-level `null` inside an `Option` reads back as `None`, by design).

use std::collections::BTreeMap;

use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};
use kvroute_protocols::request::{BlockExtraInfo, BlockMmObjectInfo};
use kvroute_protocols::{
    AgentHints, Annotated, BootstrapInfo, CompletionUsage, FinishReason, LLMEngineOutput,
    MmRoutingInfo, NvExt, NvExtResponse, OutputOptions, PrefillResult, PreprocessedRequest,
    PromptTokensDetails, RequestPhase, RouterConfigOverride, RoutingConstraints, RoutingHints,
    SamplingOptions, SessionAction, SessionControl, StopConditions, TimingInfo, WorkerIdInfo,
    WorkerLoadReport, WorkerWithDpRank,
};
use proptest::collection::vec;
use proptest::option::of;
use proptest::prelude::*;
use serde_json::Value;

pub(crate) fn text() -> impl Strategy<Value = String> {
    "\\PC{0,10}"
}

pub(crate) fn f64_exact() -> impl Strategy<Value = f64> {
    (-4_000_000i64..4_000_000).prop_map(|i| i as f64 / 8.0)
}

fn f32_exact() -> impl Strategy<Value = f32> {
    (-40_000i32..40_000).prop_map(|i| i as f32 / 4.0)
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    vec(any::<u32>(), 0..20)
}

fn strings() -> impl Strategy<Value = Vec<String>> {
    vec(text(), 0..4)
}

/// A JSON object with nested arrays, objects and scalars (no floats, no top-level null).
pub(crate) fn json_object() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    let tree = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(text(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    proptest::collection::btree_map(text(), tree, 0..4)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
}

pub(crate) fn session_action() -> impl Strategy<Value = SessionAction> {
    prop::sample::select(SessionAction::ALL.to_vec())
}

pub(crate) fn session_control() -> impl Strategy<Value = SessionControl> {
    ("\\PC{1,20}", of(session_action()), any::<u64>()).prop_map(|(session_id, action, timeout)| {
        SessionControl {
            session_id,
            action,
            timeout,
        }
    })
}

pub(crate) fn agent_hints() -> impl Strategy<Value = AgentHints> {
    (
        of(any::<i32>()),
        of(any::<u32>()),
        of(any::<bool>()),
        of(f64_exact()),
    )
        .prop_map(
            |(priority, osl, speculative_prefill, latency_sensitivity)| AgentHints {
                priority,
                osl,
                speculative_prefill,
                latency_sensitivity,
            },
        )
}

pub(crate) fn routing_constraints() -> impl Strategy<Value = RoutingConstraints> {
    (
        strings(),
        proptest::collection::btree_map(text(), f32_exact(), 0..3),
    )
        .prop_map(
            |(required_taints, preferred_taints): (Vec<String>, BTreeMap<String, f32>)| {
                RoutingConstraints {
                    required_taints,
                    preferred_taints,
                }
            },
        )
}

pub(crate) fn nvext() -> impl Strategy<Value = NvExt> {
    let a = (
        of(any::<bool>()),
        of(any::<bool>()),
        of(strings()),
        of(any::<u64>()),
        of(tokens()),
        of(any::<u32>()),
        of(strings()),
        of(any::<u64>()),
    );
    let b = (
        of(any::<u64>()),
        of(any::<u32>()),
        of(any::<u32>()),
        of(agent_hints()),
        of(f64_exact()),
        of(session_control()),
        of(routing_constraints()),
    );
    (a, b).prop_map(|(a, b)| NvExt {
        greed_sampling: a.0,
        use_raw_prompt: a.1,
        annotations: a.2,
        backend_instance_id: a.3,
        token_data: a.4,
        max_thinking_tokens: a.5,
        extra_fields: a.6,
        prefill_worker_id: a.7,
        decode_worker_id: b.0,
        dp_rank: b.1,
        prefill_dp_rank: b.2,
        agent_hints: b.3,
        request_timestamp_ms: b.4,
        session_control: b.5,
        routing_constraints: b.6,
    })
}

pub(crate) fn worker_id_info() -> impl Strategy<Value = WorkerIdInfo> {
    (
        of(any::<u64>()),
        of(any::<u32>()),
        of(any::<u64>()),
        of(any::<u32>()),
    )
        .prop_map(|t| WorkerIdInfo {
            prefill_worker_id: t.0,
            prefill_dp_rank: t.1,
            decode_worker_id: t.2,
            decode_dp_rank: t.3,
        })
}

pub(crate) fn timing_info() -> impl Strategy<Value = TimingInfo> {
    (
        of(any::<u64>()),
        of(f64_exact()),
        of(f64_exact()),
        of(f64_exact()),
        of(f64_exact()),
        of(f64_exact()),
        of(f64_exact()),
    )
        .prop_map(|t| TimingInfo {
            request_received_ms: t.0,
            prefill_wait_time_ms: t.1,
            prefill_time_ms: t.2,
            ttft_ms: t.3,
            total_time_ms: t.4,
            avg_itl_ms: t.5,
            kv_hit_rate: t.6,
        })
}

pub(crate) fn nvext_response() -> impl Strategy<Value = NvExtResponse> {
    (of(worker_id_info()), of(timing_info()), of(tokens())).prop_map(
        |(worker_id, timing, token_ids)| NvExtResponse {
            worker_id,
            timing,
            token_ids,
        },
    )
}

pub(crate) fn routing_hints() -> impl Strategy<Value = RoutingHints> {
    (
        of(any::<u64>()),
        of(any::<u64>()),
        of(any::<u64>()),
        of(any::<u32>()),
        of(any::<u32>()),
        of(any::<u32>()),
        of(any::<i32>()),
        of(text()),
        of(vec(any::<u64>(), 0..5)),
        of(session_control()),
        of(routing_constraints()),
    )
        .prop_map(|t| RoutingHints {
            backend_instance_id: t.0,
            prefill_worker_id: t.1,
            decode_worker_id: t.2,
            dp_rank: t.3,
            prefill_dp_rank: t.4,
            expected_output_tokens: t.5,
            priority: t.6,
            lora_name: t.7,
            allowed_worker_ids: t.8,
            session_control: t.9,
            routing_constraints: t.10,
        })
}

pub(crate) fn router_config_override() -> impl Strategy<Value = RouterConfigOverride> {
    (
        of(f64_exact()),
        of(f64_exact()),
        of(f64_exact()),
        of(any::<bool>()),
        of(any::<bool>()),
    )
        .prop_map(|t| RouterConfigOverride {
            overlap_score_credit: t.0,
            prefill_load_scale: t.1,
            router_temperature: t.2,
            assume_kv_reuse: t.3,
            track_prefill_tokens: t.4,
        })
}

fn stop_conditions() -> impl Strategy<Value = StopConditions> {
    (
        of(any::<u32>()),
        of(strings()),
        of(tokens()),
        of(tokens()),
        of(any::<u32>()),
        of(any::<bool>()),
        of(any::<u32>()),
    )
        .prop_map(|t| StopConditions {
            max_tokens: t.0,
            stop: t.1,
            stop_token_ids: t.2,
            stop_token_ids_hidden: t.3,
            min_tokens: t.4,
            ignore_eos: t.5,
            max_thinking_tokens: t.6,
        })
}

fn sampling_options() -> impl Strategy<Value = SamplingOptions> {
    let a = (
        of(any::<u8>()),
        of(any::<u8>()),
        of(f32_exact()),
        of(f32_exact()),
        of(f32_exact()),
        of(f32_exact()),
        of(f32_exact()),
    );
    let b = (
        of(any::<i32>()),
        of(f32_exact()),
        of(any::<bool>()),
        of(f32_exact()),
        of(any::<i64>()),
        of(any::<bool>()),
    );
    (a, b).prop_map(|(a, b)| SamplingOptions {
        n: a.0,
        best_of: a.1,
        presence_penalty: a.2,
        frequency_penalty: a.3,
        repetition_penalty: a.4,
        temperature: a.5,
        top_p: a.6,
        top_k: b.0,
        min_p: b.1,
        use_beam_search: b.2,
        length_penalty: b.3,
        seed: b.4,
        include_stop_str_in_output: b.5,
    })
}

fn output_options() -> impl Strategy<Value = OutputOptions> {
    (
        of(any::<u32>()),
        of(any::<u32>()),
        of(any::<bool>()),
        of(any::<bool>()),
    )
        .prop_map(|t| OutputOptions {
            logprobs: t.0,
            prompt_logprobs: t.1,
            skip_special_tokens: t.2,
            formatted_prompt: t.3,
        })
}

fn mm_routing_info() -> impl Strategy<Value = MmRoutingInfo> {
    let object = (any::<u64>(), vec((any::<u32>(), any::<u32>()), 0..3))
        .prop_map(|(mm_hash, offsets)| BlockMmObjectInfo { mm_hash, offsets });
    let block = of(vec(object, 0..3).prop_map(|mm_objects| BlockExtraInfo { mm_objects }));
    (tokens(), vec(block, 0..4), any::<u64>()).prop_map(
        |(routing_token_ids, block_mm_infos, expanded_prompt_len)| MmRoutingInfo {
            routing_token_ids,
            block_mm_infos,
            expanded_prompt_len,
        },
    )
}

fn prompt_tokens_details() -> impl Strategy<Value = PromptTokensDetails> {
    (of(any::<u32>()), of(any::<u32>())).prop_map(|(audio_tokens, cached_tokens)| {
        PromptTokensDetails {
            audio_tokens,
            cached_tokens,
        }
    })
}

pub(crate) fn prefill_result() -> impl Strategy<Value = PrefillResult> {
    (json_object(), of(prompt_tokens_details())).prop_map(
        |(disaggregated_params, prompt_tokens_details)| PrefillResult {
            disaggregated_params,
            prompt_tokens_details,
        },
    )
}

pub(crate) fn bootstrap_info() -> impl Strategy<Value = BootstrapInfo> {
    (text(), any::<u16>(), any::<u64>()).prop_map(
        |(bootstrap_host, bootstrap_port, bootstrap_room)| BootstrapInfo {
            bootstrap_host,
            bootstrap_port,
            bootstrap_room,
        },
    )
}

pub(crate) fn preprocessed_request() -> impl Strategy<Value = PreprocessedRequest> {
    let a = (
        text(),
        tokens(),
        of(mm_routing_info()),
        stop_conditions(),
        sampling_options(),
        output_options(),
        tokens(),
        of(text()),
    );
    let b = (
        strings(),
        of(routing_hints()),
        of(router_config_override()),
        of(prefill_result()),
        of(bootstrap_info()),
        of(json_object()),
        of(f64_exact()),
    );
    (a, b).prop_map(|(a, b)| PreprocessedRequest {
        model: a.0,
        token_ids: a.1,
        mm_routing_info: a.2,
        stop_conditions: a.3,
        sampling_options: a.4,
        output_options: a.5,
        eos_token_ids: a.6,
        mdc_sum: a.7,
        annotations: b.0,
        routing: b.1,
        router_config_override: b.2,
        prefill_result: b.3,
        bootstrap_info: b.4,
        extra_args: b.5,
        request_timestamp_ms: b.6,
    })
}

pub(crate) fn request_phase() -> impl Strategy<Value = RequestPhase> {
    prop_oneof![
        Just(RequestPhase::Prefill),
        Just(RequestPhase::Decode),
        Just(RequestPhase::Aggregated)
    ]
}

pub(crate) fn finish_reason() -> impl Strategy<Value = FinishReason> {
    prop_oneof![
        Just(FinishReason::Eos),
        Just(FinishReason::Length),
        Just(FinishReason::Stop),
        text().prop_map(FinishReason::Error),
        Just(FinishReason::Cancelled),
        Just(FinishReason::ContentFilter),
    ]
}

fn completion_usage() -> impl Strategy<Value = CompletionUsage> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        of(prompt_tokens_details()),
    )
        .prop_map(|t| CompletionUsage {
            prompt_tokens: t.0,
            completion_tokens: t.1,
            total_tokens: t.2,
            prompt_tokens_details: t.3,
        })
}

pub(crate) fn engine_output() -> impl Strategy<Value = LLMEngineOutput> {
    (
        tokens(),
        of(vec(of(text()), 0..4)),
        of(text()),
        of(f64_exact()),
        of(vec(f64_exact(), 0..4)),
        of(finish_reason()),
        of(any::<u32>()),
        of(json_object()),
        of(completion_usage()),
    )
        .prop_map(|t| LLMEngineOutput {
            token_ids: t.0,
            tokens: t.1,
            text: t.2,
            cum_log_probs: t.3,
            log_probs: t.4,
            finish_reason: t.5,
            index: t.6,
            disaggregated_params: t.7,
            completion_usage: t.8,
        })
}

pub(crate) fn annotated_output() -> impl Strategy<Value = Annotated<LLMEngineOutput>> {
    (
        of(engine_output()),
        of(text()),
        of(text()),
        of(strings()),
        of(text()),
    )
        .prop_map(|(data, id, event, comment, error)| Annotated {
            data,
            id,
            event,
            comment,
            error,
        })
}

pub(crate) fn worker_with_dp_rank() -> impl Strategy<Value = WorkerWithDpRank> {
    (any::<u64>(), any::<u32>()).prop_map(|(w, r)| WorkerWithDpRank::new(w, r))
}

pub(crate) fn worker_load_report() -> impl Strategy<Value = WorkerLoadReport> {
    (
        any::<u64>(),
        any::<u32>(),
        of(any::<u64>()),
        of(any::<u64>()),
        of(any::<u64>()),
        of(any::<u64>()),
    )
        .prop_map(
            |(
                worker_id,
                dp_rank,
                kv_used_blocks,
                kv_total_blocks,
                requests_running,
                requests_waiting,
            )| {
                WorkerLoadReport {
                    worker_id,
                    dp_rank,
                    kv_used_blocks,
                    kv_total_blocks,
                    requests_running,
                    requests_waiting,
                }
            },
        )
}

pub(crate) fn router_event() -> impl Strategy<Value = RouterEvent> {
    let hash = any::<u64>().prop_map(ExternalSequenceBlockHash);
    let block = (any::<u64>(), any::<u64>()).prop_map(|(b, t)| KvCacheStoredBlockData {
        block_hash: ExternalSequenceBlockHash(b),
        tokens_hash: LocalBlockHash(t),
    });
    let data = prop_oneof![
        (of(hash.clone()), vec(block, 0..5)).prop_map(|(parent_hash, blocks)| {
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash,
                blocks,
            })
        }),
        vec(hash, 0..5)
            .prop_map(|block_hashes| KvCacheEventData::Removed(KvCacheRemoveData { block_hashes })),
        Just(KvCacheEventData::Cleared),
    ];
    (
        any::<u64>(),
        prop::sample::select(StorageTier::ALL.to_vec()),
        any::<u64>(),
        data,
        any::<u32>(),
    )
        .prop_map(
            |(worker_id, storage_tier, event_id, data, dp_rank)| RouterEvent {
                worker_id,
                storage_tier,
                event: KvCacheEvent {
                    event_id,
                    data,
                    dp_rank,
                },
            },
        )
}
