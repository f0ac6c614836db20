use std::collections::HashMap;

use super::*;
use crate::trace::parse_jsonl;

fn blocks_for(tokens: u32) -> usize {
    (tokens as usize).div_ceil(MOONCAKE_BLOCK_TOKENS)
}

/// Properties every generated workload has: ids match the length, timestamps are ordered, a
/// session's full blocks keep their ids from one turn to the next unless the context shrank.
fn check_common(requests: &[SynthRequest]) {
    assert!(!requests.is_empty());
    for pair in requests.windows(2) {
        assert!(pair[0].record.timestamp <= pair[1].record.timestamp);
    }
    let mut last: HashMap<u64, &TraceRecord> = HashMap::new();
    for r in requests {
        assert_eq!(r.record.hash_ids.len(), blocks_for(r.record.input_length));
        if let Some(prev) = last.insert(r.session_id, &r.record)
            && prev.input_length < r.record.input_length
        {
            let full = prev.input_length as usize / MOONCAKE_BLOCK_TOKENS;
            assert_eq!(prev.hash_ids[..full], r.record.hash_ids[..full]);
        }
    }
}

#[test]
fn same_seed_same_workload_and_other_seeds_differ() {
    for name in Workload::NAMES {
        let w = Workload::from_name(name).expect("known name");
        let a = w.generate(7);
        assert_eq!(a, w.generate(7), "{name}");
        assert_ne!(a, w.generate(8), "{name}");
        check_common(&a);
    }
    assert_eq!(
        Workload::from_name("chat")
            .expect_err("unknown")
            .to_string(),
        "unknown workload `chat`: expected one of agentic, multi-turn"
    );
}

#[test]
fn agentic_contexts_grow_from_about_20k_to_200k_and_share_the_system_prompt() {
    let config = AgenticConfig::default();
    let requests = agentic(&config, 1);
    check_common(&requests);
    let lengths: Vec<u32> = requests.iter().map(|r| r.record.input_length).collect();
    assert!(lengths.iter().all(|&l| l <= config.max_context_tokens));
    assert!(lengths.iter().all(|&l| l >= 16_000), "{lengths:?}");
    assert!(lengths.iter().any(|&l| l >= 180_000));
    let mean = lengths.iter().map(|&l| f64::from(l)).sum::<f64>() / lengths.len() as f64;
    assert!((60_000.0..160_000.0).contains(&mean), "mean prompt {mean}");
    let shared = config.shared_prefix_tokens as usize / MOONCAKE_BLOCK_TOKENS;
    let first = &requests[0].record.hash_ids[..shared];
    assert!(
        requests
            .iter()
            .all(|r| &r.record.hash_ids[..shared] == first)
    );
    let top: std::collections::HashSet<u64> = requests
        .iter()
        .filter(|r| r.parent_session.is_none())
        .map(|r| r.session_id)
        .collect();
    assert_eq!(top.len(), config.sessions as usize);
}

#[test]
fn subagents_start_from_their_parents_whole_context() {
    let requests = agentic(&AgenticConfig::default(), 3);
    let mut forks = 0;
    for (i, r) in requests.iter().enumerate() {
        let Some(parent) = r.parent_session else {
            continue;
        };
        // The sub-agent's first turn extends the parent's latest context block for block.
        if requests[..i].iter().any(|q| q.session_id == r.session_id) {
            continue;
        }
        forks += 1;
        // The parent may have run more turns before the sub-agent's first one was due.
        let extends = |q: &SynthRequest| {
            let full = q.record.input_length as usize / MOONCAKE_BLOCK_TOKENS;
            q.session_id == parent
                && r.record.input_length > q.record.input_length
                && q.record.hash_ids[..full] == r.record.hash_ids[..full]
        };
        assert!(
            requests[..i].iter().any(extends),
            "sub-agent {}",
            r.session_id
        );
    }
    assert!(forks >= 5, "only {forks} sub-agents");
}

#[test]
fn multi_turn_sessions_reuse_a_few_system_prompts() {
    let config = MultiTurnConfig::default();
    let requests = multi_turn(&config, 5);
    check_common(&requests);
    let firsts: std::collections::HashSet<u64> =
        requests.iter().map(|r| r.record.hash_ids[0]).collect();
    assert!(firsts.len() <= config.system_prompts as usize);
    assert!(firsts.len() >= 2);
    let max = requests.iter().map(|r| r.record.input_length).max();
    assert!(max.is_some_and(|m| m >= 15_000), "{max:?}");
}

#[test]
fn jsonl_round_trips_through_the_trace_parser() {
    let config = MultiTurnConfig {
        sessions: 5,
        ..MultiTurnConfig::default()
    };
    let requests = multi_turn(&config, 9);
    let text = to_jsonl(&requests);
    assert!(text.contains("\"session_id\":"));
    let parsed = parse_jsonl(&text).expect("generated traces parse");
    let records: Vec<TraceRecord> = requests.into_iter().map(|r| r.record).collect();
    assert_eq!(parsed, records);
}
