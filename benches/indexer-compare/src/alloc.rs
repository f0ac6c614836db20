//! A global allocator that counts live heap bytes, so that every indexer's memory is measured the
//! same way (the reference keeps no accounting of its own, and RSS moves in pages and arenas).

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

/// One counter per thread (threads past the 64th share them round-robin), each on a cache line
/// of its own: a single shared counter made every allocation of two reader threads (or of the
/// reference's four apply threads) contend for one cache line, which held back exactly the
/// parallel figures this bench reports.
const SHARDS: usize = 64;

#[repr(align(128))]
struct Shard(AtomicIsize);

static LIVE: [Shard; SHARDS] = [const { Shard(AtomicIsize::new(0)) }; SHARDS];
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // Const-initialised and without a destructor, so the allocator may touch it at any time.
    static MY_SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Adds `delta` bytes to this thread's counter (a block freed on another thread than the one
/// that allocated it moves the two counters apart; only their sum means anything).
#[inline]
fn count(delta: isize) {
    let shard = MY_SHARD
        .try_with(|s| {
            if s.get() == usize::MAX {
                s.set(NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS);
            }
            s.get()
        })
        // During thread teardown the slot may be gone: any counter will do.
        .unwrap_or(0);
    LIVE[shard].0.fetch_add(delta, Ordering::Relaxed);
}

/// The system allocator, counting live bytes. Install it in the bench binary with
/// `#[global_allocator] static ALLOC: CountingAlloc = CountingAlloc;`.
#[derive(Debug)]
pub struct CountingAlloc;

/// Heap bytes allocated and not yet freed, by every thread (0 unless [`CountingAlloc`] is the
/// global allocator).
pub fn live_bytes() -> usize {
    let sum: isize = LIVE.iter().map(|s| s.0.load(Ordering::Relaxed)).sum();
    sum.max(0) as usize
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counter is
// bookkeeping only and never affects what is returned.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `GlobalAlloc::alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with this layout.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `new_size` is the caller's, valid per the contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize);
            count(-(layout.size() as isize));
        }
        p
    }
}
