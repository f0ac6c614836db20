//! Unit tests of the disaggregation helpers: room rendezvous in either order, params checks and
//! transfer times.

use std::time::Duration;

use serde_json::json;

use super::*;

#[tokio::test]
async fn a_room_meets_whichever_side_comes_first() {
    let rooms = BootstrapRooms::default();
    // Prefill first: the outcome waits for the pull.
    rooms.post(1, Ok(json!(1)));
    assert_eq!(rooms.pull(1).await.expect("answered"), Ok(json!(1)));
    // Decode first: the pull waits for the post.
    let waiting = rooms.pull(2);
    rooms.post(2, Err("cancelled".into()));
    assert_eq!(waiting.await.expect("answered"), Err("cancelled".into()));
    assert!(rooms.is_empty(), "pulled rooms are forgotten");
}

#[test]
fn params_must_name_this_prompts_blocks() {
    fn check(params: Value, tokens: &[u32], expect: Result<(), &str>) {
        let got = check_params(&params, tokens, 4);
        match expect {
            Ok(()) => assert_eq!(got, Ok(())),
            Err(part) => assert!(got.as_ref().is_err_and(|e| e.contains(part)), "{got:?}"),
        }
    }
    let tokens: Vec<u32> = (0..10).collect();
    check(prefill_params(3, 0, &tokens, 4), &tokens, Ok(()));
    check(
        prefill_params(3, 0, &tokens, 8),
        &tokens,
        Err("block_size must be 4"),
    );
    check(
        prefill_params(3, 0, &tokens[1..], 4),
        &tokens,
        Err("not this prompt's 2 blocks"),
    );
    check(json!({"block_size": 4}), &tokens, Err("no block_hashes"));
    let params = prefill_params(3, 1, &tokens, 4);
    assert_eq!(
        params["worker_id"],
        json!({"prefill_worker_id": 3, "prefill_dp_rank": 1})
    );
    assert_eq!(params["block_hashes"].as_array().map(Vec::len), Some(2));
}

#[test]
fn transfer_time_scales_with_blocks_and_speedup() {
    let config = DecodeConfig {
        transfer_per_block: Duration::from_millis(1),
        pull_timeout: Duration::from_secs(1),
    };
    assert_eq!(
        transfer_time(&config, 33, 16, 1.0),
        Duration::from_millis(3)
    );
    assert_eq!(
        transfer_time(&config, 32, 16, 2.0),
        Duration::from_millis(1)
    );
}
