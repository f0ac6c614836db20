//! What one policy's run measured, gathered from the engines' outputs as the simulation runs:
//! time to first token per request, inter-token latency per request, and every worker's number
//! of requests in flight over time.
//!
//! Latencies come from the same virtual clock the engines run on, so they are exact (not sampled)
//! and identical from run to run.

use std::collections::HashMap;
use std::time::Duration;

use kvroute_mocker::TokenOutput;

/// Per-request and per-worker measurements of one run.
#[derive(Debug)]
pub(crate) struct Recorder {
    in_flight: HashMap<u64, Flight>,
    /// Time to first token of every request that produced one, in the order they did.
    pub(crate) ttft: Vec<Duration>,
    /// Mean inter-token latency of every finished request with at least two tokens.
    pub(crate) itl: Vec<Duration>,
    /// Arrival to last token of every finished request.
    pub(crate) e2e: Vec<Duration>,
    pub(crate) load: LoadTimeline,
    /// Per request id: how it was routed and served (for `--requests-out`).
    pub(crate) details: Vec<RequestDetail>,
}

/// How one request was routed and what it saw, as `--requests-out` writes it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(crate) struct RequestDetail {
    /// Arrival, ms of virtual time.
    pub(crate) arrival_ms: f64,
    /// The worker it was routed to (its last one in disaggregated replay).
    pub(crate) worker: usize,
    /// Prompt length in tokens.
    pub(crate) isl_tokens: u64,
    /// Prompt blocks the index saw cached on the chosen worker.
    pub(crate) overlap_blocks: u32,
    /// The most prompt blocks cached on any candidate.
    pub(crate) best_overlap_blocks: u32,
    /// The chosen worker's outstanding prefill plus this prompt, in blocks, at routing.
    pub(crate) prefill_blocks: f64,
    /// The chosen worker's decode blocks (with this prompt's) at routing.
    pub(crate) decode_blocks: f64,
    /// Candidates scored.
    pub(crate) candidates: usize,
    /// Time to first token (ms); `None` when it produced none.
    pub(crate) ttft_ms: Option<f64>,
}

#[derive(Debug, Clone, Copy)]
struct Flight {
    worker: usize,
    arrived: Duration,
    first: Option<Duration>,
    last: Duration,
    tokens: u32,
}

impl Recorder {
    /// A recorder for `workers` workers whose load is kept in buckets of `bucket` virtual time.
    pub(crate) fn new(workers: usize, bucket: Duration) -> Self {
        Self {
            in_flight: HashMap::new(),
            ttft: Vec::new(),
            itl: Vec::new(),
            e2e: Vec::new(),
            load: LoadTimeline::new(workers, bucket),
            details: Vec::new(),
        }
    }

    /// The detail of request `id`, created on first use.
    pub(crate) fn detail(&mut self, id: u64) -> Option<&mut RequestDetail> {
        detail_in(&mut self.details, id)
    }

    /// Request `id` was sent to `worker` at `now`.
    pub(crate) fn arrived(&mut self, id: u64, worker: usize, now: Duration) {
        if let Some(d) = self.detail(id) {
            d.arrival_ms = ms_f64(now);
            d.worker = worker;
        }
        self.in_flight.insert(
            id,
            Flight {
                worker,
                arrived: now,
                first: None,
                last: now,
                tokens: 0,
            },
        );
        self.load.change(worker, now, 1);
    }

    /// Request `id` moved to `worker` at `now` (disaggregated replay: from its prefill worker
    /// to its decode worker), so the load timeline follows it.
    pub(crate) fn moved(&mut self, id: u64, worker: usize, now: Duration) {
        let Some(f) = self.in_flight.get_mut(&id) else {
            return;
        };
        let from = std::mem::replace(&mut f.worker, worker);
        if let Some(d) = self.details.get_mut(id as usize) {
            d.worker = worker;
        }
        self.load.change(from, now, -1);
        self.load.change(worker, now, 1);
    }

    /// A token came out.
    pub(crate) fn token(&mut self, token: &TokenOutput) {
        let Some(f) = self.in_flight.get_mut(&token.request_id) else {
            return;
        };
        if f.first.is_none() {
            f.first = Some(token.at);
            let ttft = token.at.saturating_sub(f.arrived);
            self.ttft.push(ttft);
            if let Some(d) = detail_in(&mut self.details, token.request_id) {
                d.ttft_ms = Some(ms_f64(ttft));
            }
        }
        f.last = token.at;
        f.tokens += 1;
    }

    /// Request `id` left its worker at `at`, finished (`completed`) or refused or failed.
    pub(crate) fn left(&mut self, id: u64, at: Duration, completed: bool) {
        let Some(f) = self.in_flight.remove(&id) else {
            return;
        };
        self.load.change(f.worker, at, -1);
        if !completed {
            return;
        }
        self.e2e.push(f.last.saturating_sub(f.arrived));
        if let Some(first) = f.first
            && f.tokens >= 2
        {
            self.itl.push(f.last.saturating_sub(first) / (f.tokens - 1));
        }
    }

    /// Requests not yet finished.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

/// Requests in flight per worker, integrated over virtual time: in total and per time bucket.
#[derive(Debug)]
pub(crate) struct LoadTimeline {
    bucket: Duration,
    workers: Vec<WorkerLine>,
}

#[derive(Debug, Default)]
struct WorkerLine {
    count: u64,
    since: Duration,
    /// Request-seconds in flight, in total and per bucket.
    total: f64,
    buckets: Vec<f64>,
}

impl LoadTimeline {
    /// `workers` idle workers at time zero.
    pub(crate) fn new(workers: usize, bucket: Duration) -> Self {
        Self {
            bucket: bucket.max(Duration::from_millis(1)),
            workers: (0..workers).map(|_| WorkerLine::default()).collect(),
        }
    }

    /// Worker `worker`'s count changes by `delta` at `at` (times never go backwards per worker).
    pub(crate) fn change(&mut self, worker: usize, at: Duration, delta: i64) {
        let bucket = self.bucket;
        let Some(line) = self.workers.get_mut(worker) else {
            return;
        };
        line.advance(at, bucket);
        line.count = line.count.saturating_add_signed(delta);
    }

    /// Closes every line at `end` (the end of the run) so the integrals cover the whole run.
    pub(crate) fn finish(&mut self, end: Duration) {
        let bucket = self.bucket;
        for line in &mut self.workers {
            line.advance(end, bucket);
        }
    }

    /// The bucket width.
    pub(crate) fn bucket(&self) -> Duration {
        self.bucket
    }

    /// Mean requests in flight per worker over `[0, end]`.
    pub(crate) fn mean_per_worker(&self, end: Duration) -> Vec<f64> {
        let secs = end.as_secs_f64();
        self.workers
            .iter()
            .map(|l| if secs > 0.0 { l.total / secs } else { 0.0 })
            .collect()
    }

    /// Mean requests in flight per worker and bucket: `[worker][bucket]`, every row as long as
    /// the longest.
    pub(crate) fn series(&self) -> Vec<Vec<f64>> {
        let len = self
            .workers
            .iter()
            .map(|l| l.buckets.len())
            .max()
            .unwrap_or(0);
        let width = self.bucket.as_secs_f64();
        self.workers
            .iter()
            .map(|l| {
                let mut row: Vec<f64> = l.buckets.iter().map(|v| v / width).collect();
                row.resize(len, 0.0);
                row
            })
            .collect()
    }
}

impl WorkerLine {
    /// Adds `count` over `[since, at)` to the total and to the buckets it spans.
    fn advance(&mut self, at: Duration, bucket: Duration) {
        if at <= self.since {
            return;
        }
        if self.count > 0 {
            let count = self.count as f64;
            self.total += count * (at - self.since).as_secs_f64();
            let mut t = self.since;
            while t < at {
                let index = (t.as_nanos() / bucket.as_nanos()) as usize;
                let bucket_end = bucket * (index as u32 + 1);
                let until = bucket_end.min(at);
                if self.buckets.len() <= index {
                    self.buckets.resize(index + 1, 0.0);
                }
                self.buckets[index] += count * (until - t).as_secs_f64();
                t = until;
            }
        }
        self.since = at;
    }
}

/// The entry of request `id` in `details`, created on first use.
fn detail_in(details: &mut Vec<RequestDetail>, id: u64) -> Option<&mut RequestDetail> {
    let i = usize::try_from(id).ok()?;
    if details.len() <= i {
        details.resize(i + 1, RequestDetail::default());
    }
    details.get_mut(i)
}

fn ms_f64(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q` quantile (nearest rank, as the mocker's summaries) of sorted `samples`; zero when
/// empty.
pub(crate) fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let n = sorted.len();
    if n == 0 {
        return Duration::ZERO;
    }
    sorted[((n as f64 * q).ceil() as usize).clamp(1, n) - 1]
}

/// `max / mean` of `values` (1.0 is perfect balance); 0 when the mean is 0.
pub(crate) fn max_over_mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 { max / mean } else { 0.0 }
}

#[cfg(test)]
mod tests;
