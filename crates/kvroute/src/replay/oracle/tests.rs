use kvroute_mocker::trace::TraceRecord;

use super::Oracle;

fn rec(input_length: u32, hash_ids: &[u64]) -> TraceRecord {
    TraceRecord {
        timestamp: 0.0,
        input_length,
        output_length: 1,
        hash_ids: hash_ids.to_vec(),
    }
}

/// Runs the oracle with T = 4 and B = 2 over `records` and compares
/// `(reused_blocks, blocks, reused_tokens, tokens)`.
fn check(records: &[TraceRecord], expect: (u64, u64, u64, u64)) {
    let o = Oracle::compute(records, 4, 2);
    assert_eq!(
        (o.reused_blocks, o.blocks, o.reused_tokens, o.tokens),
        expect,
        "records: {records:?}"
    );
}

#[test]
fn empty_trace_reuses_nothing() {
    check(&[], (0, 0, 0, 0));
    let o = Oracle::compute(&[], 512, 16);
    assert_eq!((o.block_hit_rate(), o.token_hit_rate()), (0.0, 0.0));
}

#[test]
fn first_request_reuses_nothing() {
    check(&[rec(8, &[1, 2])], (0, 2, 0, 8));
}

#[test]
fn shared_leading_run_is_reused() {
    // The second prompt shares block 1 (4 tokens) and then diverges.
    check(&[rec(8, &[1, 2]), rec(8, &[1, 3])], (1, 4, 4, 16));
}

#[test]
fn reuse_stops_at_the_first_unseen_block() {
    // Block 2 was seen but block 9 before it was not: a prefix cache cannot skip a gap.
    check(&[rec(8, &[1, 2]), rec(12, &[1, 9, 2])], (1, 5, 4, 20));
}

#[test]
fn identical_prompt_keeps_its_last_token_to_compute() {
    // 8 tokens all cached by the trace, but the engine computes at least one token and caches
    // whole 2-token blocks: (8 - 1) / 2 * 2 = 6.
    check(&[rec(8, &[1, 2]), rec(8, &[1, 2])], (2, 4, 6, 16));
}

#[test]
fn short_last_block_caps_reused_tokens() {
    // The second prompt has 6 tokens: its run covers 8 trace tokens, capped at (6 - 1) / 2 * 2.
    check(&[rec(8, &[1, 2]), rec(6, &[1, 2])], (2, 4, 4, 14));
}

#[test]
fn ids_seen_within_the_same_request_do_not_count() {
    check(&[rec(8, &[5, 5])], (0, 2, 0, 8));
}

#[test]
fn empty_prompt_counts_no_tokens() {
    check(&[rec(4, &[1]), rec(0, &[1])], (1, 2, 0, 4));
}

#[test]
fn rates_divide_reused_by_total() {
    let o = Oracle::compute(&[rec(8, &[1, 2]), rec(8, &[1, 3])], 4, 2);
    assert_eq!(o.block_hit_rate(), 0.25);
    assert_eq!(o.token_hit_rate(), 0.25);
}
