//! Synchronization primitives, swapped for loom's when model checking (`--cfg loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard, RwLock, RwLockWriteGuard};
#[cfg(loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread::yield_now;
// Readers take a read lock per query: with one lock word, every query on one core invalidated it
// in the other core's cache (two readers answered 1.6x of one). A sharded lock gives each thread
// its own word to read-lock; a writer takes them all, once per piece of up to a few hundred
// blocks.
#[cfg(not(loom))]
pub(crate) use crossbeam_utils::sync::{
    ShardedLock as RwLock, ShardedLockWriteGuard as RwLockWriteGuard,
};

/// Locks a mutex; a panic elsewhere must not wedge the index, so poisoning is ignored (every
/// critical section leaves the data consistent between statements that can panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
