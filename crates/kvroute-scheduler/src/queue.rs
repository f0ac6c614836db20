//! The admission queue: requests wait here while every eligible worker is full.
//!
//! The queue only orders and bounds; it stores the caller's request as is, so a released request
//! goes through [`crate::Scheduler::select`] again and is scored against the load at release
//! time, not the load it saw when it arrived.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

/// How waiting requests are ordered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QueuePolicy {
    /// First come, first served; a priority of `p` counts as having arrived `p` seconds earlier
    /// (the reference's "priority jump").
    #[default]
    Fcfs,
    /// Shortest work first weighted by priority (Smith's rule): highest `(1 + p) / work` first,
    /// where work is the prompt tokens left to prefill on the best worker.
    ShortestWorkFirst,
}

/// Ordering inputs of one waiting request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueMeta {
    /// When it arrived (same clock as the scheduler's `now`).
    pub arrival: Duration,
    /// Priority jump, >= 0 (negative values count as 0).
    pub priority: f64,
    /// Prompt tokens to prefill on its best worker (for shortest-work-first; at least 1 is used).
    pub work_tokens: u64,
}

/// The queue refused the item; it is handed back (like tokio's `TrySendError::Full`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TryPushError<T> {
    /// The queue holds `capacity` requests already.
    #[error("admission queue is full ({capacity} waiting requests); retry later or shed load")]
    Full {
        /// The refused request.
        item: T,
        /// The queue's capacity.
        capacity: usize,
    },
}

impl<T> TryPushError<T> {
    /// The refused request.
    pub fn into_inner(self) -> T {
        match self {
            TryPushError::Full { item, .. } => item,
        }
    }
}

struct Entry<T> {
    key: f64,
    seq: u64,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    /// Higher key first; among equal keys, earlier insertion first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.key
            .total_cmp(&other.key)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// A bounded priority queue of waiting requests.
pub struct AdmissionQueue<T> {
    policy: QueuePolicy,
    capacity: usize,
    heap: BinaryHeap<Entry<T>>,
    next_seq: u64,
}

impl<T> std::fmt::Debug for AdmissionQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionQueue")
            .field("policy", &self.policy)
            .field("capacity", &self.capacity)
            .field("len", &self.heap.len())
            .finish()
    }
}

impl<T> AdmissionQueue<T> {
    /// An empty queue holding at most `capacity` requests (0 refuses everything).
    pub fn new(policy: QueuePolicy, capacity: usize) -> Self {
        Self {
            policy,
            capacity,
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }

    /// Enqueues `item`, or hands it back when the queue is full.
    pub fn try_push(&mut self, item: T, meta: QueueMeta) -> Result<(), TryPushError<T>> {
        if self.heap.len() >= self.capacity {
            return Err(TryPushError::Full {
                item,
                capacity: self.capacity,
            });
        }
        let priority = if meta.priority.is_finite() {
            meta.priority.max(0.0)
        } else {
            0.0
        };
        let key = match self.policy {
            QueuePolicy::Fcfs => priority - meta.arrival.as_secs_f64(),
            QueuePolicy::ShortestWorkFirst => (1.0 + priority) / meta.work_tokens.max(1) as f64,
        };
        self.heap.push(Entry {
            key,
            seq: self.next_seq,
            item,
        });
        self.next_seq += 1;
        Ok(())
    }

    /// The request that would be released next.
    pub fn peek(&self) -> Option<&T> {
        self.heap.peek().map(|e| &e.item)
    }

    /// Releases the next request.
    pub fn pop(&mut self) -> Option<T> {
        self.heap.pop().map(|e| e.item)
    }

    /// Releases the next request if `ready` accepts it (e.g. "a worker has room for it now").
    pub fn pop_if(&mut self, ready: impl FnOnce(&T) -> bool) -> Option<T> {
        if ready(self.peek()?) {
            self.pop()
        } else {
            None
        }
    }

    /// Number of waiting requests.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// The bound given at construction.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
