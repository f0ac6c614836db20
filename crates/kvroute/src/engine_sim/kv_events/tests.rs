//! The token bookkeeping between the HTTP side and the feed: a stored block carries the tokens a
//! request registered, a block stays known while cached after its request lets go, and a chain
//! whose tokens never came is cut.

use std::sync::Arc;

use kvroute_indexer::hash::{HashSalt, compute_block_hashes, compute_seq_hashes};
use kvroute_protocols::kv_events::{
    ExternalSequenceBlockHash as H, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};
use kvroute_protocols::zmq_events::{BlockRemoved, BlockStored, EngineKvEvent};

use super::{BlockTokens, RequestBlocks, translate};

const BLOCK: u32 = 4;

/// The mocker's names of the full blocks of `tokens`.
fn seq_hashes(tokens: &[u32]) -> Vec<u64> {
    let locals = compute_block_hashes(tokens, BLOCK as usize, &HashSalt::default());
    compute_seq_hashes(&locals)
        .into_iter()
        .map(|s| s.0)
        .collect()
}

fn event(data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: 0,
        storage_tier: StorageTier::Device,
        event: KvCacheEvent {
            event_id: 0,
            data,
            dp_rank: 0,
        },
    }
}

fn stored(parent: Option<u64>, hashes: &[u64]) -> RouterEvent {
    event(KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(H),
        blocks: hashes
            .iter()
            .map(|&h| KvCacheStoredBlockData {
                block_hash: H(h),
                tokens_hash: LocalBlockHash(0),
            })
            .collect(),
    }))
}

fn removed(hashes: &[u64]) -> RouterEvent {
    event(KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
    }))
}

fn vllm_stored(parent: Option<u64>, hashes: &[u64], tokens: &[u32]) -> EngineKvEvent {
    EngineKvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        parent_block_hash: parent.map(H),
        token_ids: tokens.to_vec(),
        block_size: BLOCK,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    })
}

fn vllm_removed(hashes: &[u64]) -> EngineKvEvent {
    EngineKvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| H(h)).collect(),
        medium: Some("GPU".into()),
        ..BlockRemoved::default()
    })
}

async fn check(store: &BlockTokens, input: RouterEvent, expect: Vec<EngineKvEvent>) {
    let mut out = Vec::new();
    translate(store, input, BLOCK, &mut out).await;
    assert_eq!(out, expect);
}

/// Lets go of a request's blocks at once (its drop waits out the grace period).
fn end(mut request: RequestBlocks, store: &BlockTokens) {
    let held = std::mem::take(&mut request.held);
    drop(request);
    store.release(&held);
}

#[tokio::test]
async fn stored_blocks_carry_the_tokens_their_request_registered() {
    let store = Arc::new(BlockTokens::default());
    let all: Vec<u32> = (1..=12).collect();
    let hashes = seq_hashes(&all);
    let mut request = RequestBlocks::new(Arc::clone(&store), BLOCK);
    // Ten prompt tokens (two full blocks), then output that completes the third.
    request.push(&all[..10]);
    assert_eq!(store.blocks.lock().len(), 2);
    request.push(&all[10..]);
    check(
        &store,
        stored(None, &hashes[..2]),
        vec![vllm_stored(None, &hashes[..2], &all[..8])],
    )
    .await;
    check(
        &store,
        stored(Some(hashes[1]), &hashes[2..]),
        vec![vllm_stored(Some(hashes[1]), &hashes[2..], &all[8..])],
    )
    .await;

    // The request lets go: the cached blocks stay known until the engine evicts them.
    end(request, &store);
    assert_eq!(store.blocks.lock().len(), 3);
    check(
        &store,
        removed(&hashes[2..]),
        vec![vllm_removed(&hashes[2..])],
    )
    .await;
    assert_eq!(store.blocks.lock().len(), 2);
    check(
        &store,
        removed(&hashes[..2]),
        vec![vllm_removed(&hashes[..2])],
    )
    .await;
    assert!(store.blocks.lock().is_empty());
}

#[tokio::test]
async fn a_stored_block_waits_for_tokens_still_on_their_way() {
    let store = Arc::new(BlockTokens::default());
    let tokens: Vec<u32> = (1..=4).collect();
    let hashes = seq_hashes(&tokens);
    let late = Arc::clone(&store);
    let register = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut request = RequestBlocks::new(late, BLOCK);
        request.push(&(1..=4).collect::<Vec<_>>());
        request
    });
    check(
        &store,
        stored(None, &hashes),
        vec![vllm_stored(None, &hashes, &tokens)],
    )
    .await;
    end(register.await.expect("registered"), &store);
}

#[tokio::test]
async fn a_chain_is_cut_at_a_block_whose_tokens_never_came() {
    let store = Arc::new(BlockTokens::default());
    let tokens: Vec<u32> = (1..=4).collect();
    let hashes = seq_hashes(&tokens);
    let mut request = RequestBlocks::new(Arc::clone(&store), BLOCK);
    request.push(&tokens);
    check(
        &store,
        stored(None, &[hashes[0], 99]),
        vec![vllm_stored(None, &hashes, &tokens)],
    )
    .await;
    check(&store, stored(None, &[98]), vec![]).await;
    end(request, &store);
}
