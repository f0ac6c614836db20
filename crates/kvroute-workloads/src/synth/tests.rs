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
        "unknown workload `chat`: expected one of agentic, agentic-tools, multi-turn, rag, bursty"
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
    assert!(text.contains("\"session_id\":\"0\""), "{text}");
    let parsed = parse_jsonl(&text).expect("generated traces parse");
    let records: Vec<TraceRecord> = requests.into_iter().map(|r| r.record).collect();
    assert_eq!(parsed, records);
}

#[test]
fn agentic_defaults_make_no_tool_calls_or_idle_gaps_and_agentic_tools_does() {
    let plain = AgenticConfig::default();
    assert_eq!(plain.tool_call_probability, 0.0);
    assert_eq!(plain.idle_probability, 0.0);

    let config = AgenticConfig::with_tools();
    let requests = agentic(&config, 4);
    check_common(&requests);
    let lengths: Vec<u32> = requests.iter().map(|r| r.record.input_length).collect();
    assert!(lengths.iter().all(|&l| l <= config.max_context_tokens));
    assert!(lengths.iter().all(|&l| l >= 20_000), "{lengths:?}");
    assert!(lengths.iter().any(|&l| l >= 150_000));
    // Tool calls: short outputs on most turns.
    let (lo, hi) = config.tool_output_tokens;
    let short = requests
        .iter()
        .filter(|r| (lo..=hi).contains(&r.record.output_length))
        .count();
    let share = short as f64 / requests.len() as f64;
    assert!((0.55..0.9).contains(&share), "short outputs {share}");
    // Idle gaps: some session waits at least the shortest idle gap between two turns, and far
    // more turns follow within a tool call's gap.
    let mut last: HashMap<u64, f64> = HashMap::new();
    let (mut idle, mut quick) = (0, 0);
    for r in &requests {
        if let Some(prev) = last.insert(r.session_id, r.record.timestamp) {
            let gap = r.record.timestamp - prev;
            if gap >= f64::from(config.idle_gap_ms.0) {
                idle += 1;
            }
            if gap <= f64::from(config.tool_gap_ms.1) {
                quick += 1;
            }
        }
    }
    assert!(idle >= 3, "{idle} idle gaps");
    assert!(quick > 10 * idle, "{quick} quick turns vs {idle} idle gaps");
    let forks: std::collections::HashSet<u64> = requests
        .iter()
        .filter(|r| r.parent_session.is_some())
        .map(|r| r.session_id)
        .collect();
    assert!(forks.len() >= 10, "{} sub-agents", forks.len());
}

#[test]
fn rag_questions_share_a_few_popular_documents() {
    let config = RagConfig::default();
    let requests = rag(&config, 6);
    check_common(&requests);
    // The document prefix: every first question of the same (prompt, document) shares the ids of
    // all the blocks before the question, and the most popular prefix draws many users.
    let mut by_prefix: HashMap<Vec<u64>, usize> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for r in &requests {
        if !seen.insert(r.session_id) {
            continue;
        }
        let min_doc = config.document_tokens.0 as usize / MOONCAKE_BLOCK_TOKENS;
        *by_prefix
            .entry(r.record.hash_ids[..min_doc].to_vec())
            .or_default() += 1;
    }
    assert_eq!(seen.len(), config.sessions as usize);
    assert!(by_prefix.len() <= (config.documents * config.system_prompts) as usize);
    let top = by_prefix.values().copied().max().unwrap_or(0);
    assert!(top >= 30, "most popular document asked by {top} users");
    assert!(
        by_prefix.len() >= 20,
        "{} documents asked about",
        by_prefix.len()
    );
    let lengths: Vec<u32> = requests.iter().map(|r| r.record.input_length).collect();
    assert!(lengths.iter().all(|&l| l >= config.document_tokens.0));
    assert!(
        requests
            .iter()
            .all(|r| r.record.output_length <= config.output_tokens.1)
    );
    // Follow-ups extend the same user's conversation.
    let followups = requests.len() - seen.len();
    assert!(followups >= requests.len() / 3, "{followups} follow-ups");
}

#[test]
fn bursty_mixes_the_others_in_bursts_without_sharing_their_content() {
    let config = BurstyConfig::default();
    let requests = bursty(&config, 2);
    check_common(&requests);
    // Every arrival falls in the first burst_ms of its period.
    for r in &requests {
        let offset = r.record.timestamp % config.period_ms;
        assert!(
            offset <= config.burst_ms,
            "arrival {offset} ms into its period"
        );
    }
    // All three parts are there, with disjoint sessions and content.
    let part = |r: &SynthRequest| {
        let agents = agentic(&config.agentic, 2)
            .iter()
            .map(|q| q.session_id)
            .max()
            .unwrap_or(0);
        if r.session_id <= agents {
            0
        } else if r.session_id <= agents + u64::from(config.multi_turn.sessions) {
            1
        } else {
            2
        }
    };
    let mut ids: [std::collections::HashSet<u64>; 3] = Default::default();
    let mut counts = [0usize; 3];
    for r in &requests {
        let p = part(r);
        counts[p] += 1;
        ids[p].extend(r.record.hash_ids.iter().copied());
    }
    assert!(counts.iter().all(|&c| c > 50), "{counts:?}");
    assert!(ids[0].is_disjoint(&ids[1]) && ids[1].is_disjoint(&ids[2]));
    assert!(ids[0].is_disjoint(&ids[2]));
    let expected = agentic(&config.agentic, 2).len()
        + multi_turn(&config.multi_turn, 3).len()
        + rag(&config.rag, 4).len();
    assert_eq!(requests.len(), expected);
    // Bursts are dense: arrivals per busy second exceed the average by the squeeze factor.
    let span = requests.last().map_or(0.0, |r| r.record.timestamp);
    let periods = (span / config.period_ms).ceil().max(1.0);
    let busy_rate = requests.len() as f64 / (periods * config.burst_ms);
    let mean_rate = requests.len() as f64 / span;
    assert!(busy_rate >= 4.0 * mean_rate, "{busy_rate} vs {mean_rate}");
}

#[test]
fn scaled_workloads_keep_their_shape_with_fewer_sessions() {
    for name in Workload::NAMES {
        let w = Workload::from_name(name).expect("known name");
        let full = w.generate(1);
        let small = w.scaled(0.1).generate(1);
        check_common(&small);
        assert!(
            small.len() * 4 < full.len(),
            "{name}: {} vs {}",
            small.len(),
            full.len()
        );
        assert_eq!(small, w.scaled(0.1).generate(1), "{name}");
    }
}
