import json, sys
import dynamo.llm as llm
import dynamo.replay as replay

trace, mode = sys.argv[1], sys.argv[2]
workers, trace_block, block, blocks = (int(a) for a in sys.argv[3:7])
report = replay.run_trace_replay(
    [trace],
    extra_engine_args={"engine": {"block_size": block, "num_gpu_blocks": blocks},
                       "num_gpu_blocks_is_explicit": True},
    num_workers=workers,
    router_mode=mode,
    trace_block_size=trace_block,
    trace_format="mooncake",
    replay_mode="offline",
    router_config=llm.KvRouterConfig(),
)
summary = report.to_dict()["summary"]
keys = ["num_requests", "completed_requests", "prefix_cache_reused_ratio",
        "median_ttft_ms", "p99_ttft_ms", "p99_e2e_latency_ms"]
print(json.dumps({key: summary[key] for key in keys}))
