//! An engine's own load, read from its Prometheus `/metrics`: requests running and waiting, and
//! KV blocks in use, per data-parallel rank. [`crate::HttpEngine::load`] fetches the text; this
//! module reads it, without I/O.
//!
//! Where each figure comes from, checked against the engines' sources (vLLM 0.33.0, SGLang
//! 0.5.23) and a real llama.cpp server (the `xllamacpp` wheel 2026.10.11549):
//!
//! - vLLM: `vllm:num_requests_running` and `vllm:num_requests_waiting` (which counts the requests
//!   waiting for capacity and those deferred), one series per engine core labelled
//!   `engine="N"`, the data-parallel rank. KV: `vllm:kv_cache_usage_perc` (older vLLM:
//!   `vllm:gpu_cache_usage_perc`, deprecated by vllm-project/vllm#18354) is
//!   `1 - free / (num_gpu_blocks - 1)` (the null block aside), and `vllm:cache_config_info`
//!   states `num_gpu_blocks` and `block_size` as labels, so the blocks in use are
//!   `usage * (num_gpu_blocks - 1)`, rounded to the nearest whole block, of
//!   `num_gpu_blocks - 1` in all. A server fronting
//!   several engines states the SUM of their blocks there (`core_client.py`), so each engine's
//!   own total, and its blocks in use, cannot be known: the KV figure is then `None`.
//! - SGLang (`--enable-metrics`): `sglang:num_running_reqs`, `sglang:num_queue_reqs` plus
//!   `sglang:num_grammar_queue_reqs` (requests waiting for their grammar) and, under
//!   prefill/decode disaggregation, the queues a request waits in before it can run:
//!   `sglang:num_prefill_bootstrap_queue_reqs` (a prefill worker's requests waiting for the
//!   decode side's handshake), `sglang:num_decode_prealloc_queue_reqs` and
//!   `sglang:num_decode_transfer_queue_reqs` (a decode worker's requests waiting for KV memory,
//!   then for their KV to arrive; `num_decode_host_receive_queue_reqs` is a part of the transfer
//!   queue, and a prefill worker's `num_prefill_inflight_queue_reqs` have finished their
//!   prefill and only send their KV, so neither is added). Labelled `dp_rank`
//!   under data parallelism. With priority scheduling the totals are the series with
//!   `priority=""` (the others are per priority). Only one scheduler per rank reports unless
//!   `--enable-metrics-for-all-schedulers`, whose extra series are copies: the one with the
//!   lowest `pp_rank`, then `tp_rank`, is read. KV: `sglang:kv_used_tokens` (token slots held
//!   by running requests; older SGLang: `sglang:num_used_tokens`), of
//!   `sglang:max_total_num_tokens` in all.
//! - llama.cpp (`llama-server --metrics`): `llamacpp:requests_processing` (busy slots) and
//!   `llamacpp:requests_deferred` (requests waiting for a slot); one rank. It states no KV use.
//! - TensorRT-LLM (`trtllm-serve`) and plain OpenAI servers publish no Prometheus request gauges
//!   kvroute can rely on (TensorRT-LLM 1.1's `/prometheus/metrics` holds request counters and
//!   latency histograms only; its JSON `/metrics` iteration statistics are not read here):
//!   [`LoadError::Unsupported`].

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use kvroute_protocols::{DpRank, WorkerId, WorkerLoadReport};

use crate::config::EngineKind;
use crate::exposition::{self, Sample};

/// One data-parallel rank's load as its engine states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLoad {
    /// The data-parallel rank (vLLM's `engine` label, SGLang's `dp_rank`; 0 otherwise).
    pub dp_rank: DpRank,
    /// Requests the engine is running (in its batch; llama.cpp: busy slots).
    pub requests_running: u64,
    /// Requests the engine holds but does not run yet.
    pub requests_waiting: u64,
    /// KV cache blocks in use, in blocks of the `block_size` given to
    /// [`crate::HttpEngine::load`] (tokens rounded up to whole blocks); `None` when the engine
    /// does not state it exactly.
    pub kv_used_blocks: Option<u64>,
    /// KV cache blocks the rank has in all, in the same blocks (rounded down); `None` when the
    /// engine does not state it for this rank alone.
    pub kv_total_blocks: Option<u64>,
}

impl EngineLoad {
    /// This load as `worker_id`'s report for the router.
    pub fn report(&self, worker_id: WorkerId) -> WorkerLoadReport {
        let report = WorkerLoadReport::new(worker_id)
            .with_dp_rank(self.dp_rank)
            .with_requests(self.requests_running, self.requests_waiting);
        let report = match self.kv_used_blocks {
            Some(blocks) => report.with_kv_used_blocks(blocks),
            None => report,
        };
        match self.kv_total_blocks {
            Some(blocks) => report.with_kv_total_blocks(blocks),
            None => report,
        }
    }
}

/// Why [`crate::HttpEngine::load`] could not read an engine's load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The engine publishes no load figures kvroute can read (TensorRT-LLM, a plain OpenAI
    /// server).
    #[error("reading the load of a {kind} engine is not supported: it publishes no request gauges")]
    Unsupported {
        /// The engine's dialect.
        kind: EngineKind,
    },
    /// No answer: connection refused or reset, or the health timeout passed.
    #[error("engine metrics at {url} are unreachable: {message}")]
    Unreachable {
        /// The metrics endpoint.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The engine answered with a status other than 2xx.
    #[error("engine metrics at {url} answered HTTP {status}: {message}{}", metrics_hint(*.status))]
    Status {
        /// The metrics endpoint.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The engine's error message, or its body.
        message: String,
    },
    /// The body is not Prometheus text: not UTF-8, too large, or a line that does not parse.
    #[error("engine metrics at {url} are not Prometheus text: {message}")]
    Malformed {
        /// The metrics endpoint.
        url: String,
        /// What was wrong, with the line number when a line is at fault.
        message: String,
    },
    /// A metric the load needs is absent.
    #[error(
        "engine metrics at {url} have no `{metric}` (is the engine the kind the config names?)"
    )]
    MissingMetric {
        /// The metrics endpoint.
        url: String,
        /// The metric (with the label selecting the rank, when one rank lacks it).
        metric: String,
    },
    /// A request count that is not a whole number of requests (negative, fractional, NaN).
    #[error("engine metrics at {url} give `{series}` = {value}; expected a whole number >= 0")]
    InvalidValue {
        /// The series, as written: `name{labels}`.
        series: String,
        /// The value, as read.
        value: String,
        /// The metrics endpoint.
        url: String,
    },
}

fn metrics_hint(status: u16) -> &'static str {
    match status {
        404 | 501 => {
            " (is the engine serving metrics? SGLang needs --enable-metrics, llama-server --metrics)"
        }
        _ => "",
    }
}

/// The metric names of one engine's load figures.
struct Names {
    running: &'static str,
    waiting: &'static str,
    /// Counted as waiting too where present.
    waiting_extra: &'static [&'static str],
}

/// Reads the load out of the `/metrics` text of a `kind` engine fetched from `url`.
pub(crate) fn read(
    kind: EngineKind,
    text: &str,
    block_size: NonZeroU32,
    url: &str,
) -> Result<Vec<EngineLoad>, LoadError> {
    let samples = exposition::parse(text).map_err(|e| LoadError::Malformed {
        url: url.to_owned(),
        message: e.to_string(),
    })?;
    let reader = Reader {
        samples: &samples,
        url,
    };
    match kind {
        EngineKind::Vllm => reader.vllm(block_size),
        EngineKind::Sglang => reader.sglang(block_size),
        EngineKind::Llamacpp => reader
            .requests(
                &Names {
                    running: "llamacpp:requests_processing",
                    waiting: "llamacpp:requests_deferred",
                    waiting_extra: &[],
                },
                &Ranks::Single,
            )
            .map(|loads| loads.into_values().collect()),
        EngineKind::Trtllm | EngineKind::Openai => Err(LoadError::Unsupported { kind }),
    }
}

/// How an engine's series are sorted into data-parallel ranks.
enum Ranks {
    /// One rank, 0; several series of a name are summed.
    Single,
    /// By vLLM's `engine` label; series of one rank are summed (one per served model).
    VllmEngine,
    /// By SGLang's `dp_rank` label (0 when absent), reading only totals (`priority` empty or
    /// absent) and, of several series of one rank, the lowest `pp_rank` then `tp_rank`.
    SglangDpRank,
}

struct Reader<'s, 'a> {
    samples: &'s [Sample<'a>],
    url: &'s str,
}

impl Reader<'_, '_> {
    fn vllm(&self, block_size: NonZeroU32) -> Result<Vec<EngineLoad>, LoadError> {
        let names = Names {
            running: "vllm:num_requests_running",
            waiting: "vllm:num_requests_waiting",
            waiting_extra: &[],
        };
        let mut loads = self.requests(&names, &Ranks::VllmEngine)?;
        let usage = self.values_or_older(
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            &Ranks::VllmEngine,
        );
        // The server states one `num_gpu_blocks`, summed over all its engines: it is one
        // engine's only when it fronts one.
        let info = self.vllm_cache_info().filter(|_| loads.len() == 1);
        if let Some(info) = info {
            for (rank, load) in &mut loads {
                load.kv_used_blocks = usage
                    .get(rank)
                    .and_then(|&usage| blocks_in_use(usage, info.num_gpu_blocks))
                    .map(|used| rebase(used, info.block_size, block_size));
                // vLLM's null block is never handed out: `num_gpu_blocks - 1` are usable.
                load.kv_total_blocks = info
                    .num_gpu_blocks
                    .checked_sub(1)
                    .filter(|&n| n > 0)
                    .map(|usable| rebase_down(usable, info.block_size, block_size))
                    .filter(|&n| n > 0);
            }
        }
        Ok(loads.into_values().collect())
    }

    fn sglang(&self, block_size: NonZeroU32) -> Result<Vec<EngineLoad>, LoadError> {
        let names = Names {
            running: "sglang:num_running_reqs",
            waiting: "sglang:num_queue_reqs",
            waiting_extra: &[
                "sglang:num_grammar_queue_reqs",
                "sglang:num_prefill_bootstrap_queue_reqs",
                "sglang:num_decode_prealloc_queue_reqs",
                "sglang:num_decode_transfer_queue_reqs",
            ],
        };
        let mut loads = self.requests(&names, &Ranks::SglangDpRank)?;
        let used = self.values_or_older(
            "sglang:kv_used_tokens",
            "sglang:num_used_tokens",
            &Ranks::SglangDpRank,
        );
        let total = self.values("sglang:max_total_num_tokens", &Ranks::SglangDpRank);
        let total = total.unwrap_or_default();
        for (rank, load) in &mut loads {
            load.kv_used_blocks = used
                .get(rank)
                .and_then(|&tokens| whole(tokens))
                .map(|tokens| tokens.div_ceil(u64::from(block_size.get())));
            load.kv_total_blocks = total
                .get(rank)
                .and_then(|&tokens| whole(tokens))
                .map(|tokens| tokens / u64::from(block_size.get()))
                .filter(|&blocks| blocks > 0);
        }
        Ok(loads.into_values().collect())
    }

    /// Running and waiting requests per rank: every rank with either must have both.
    fn requests(
        &self,
        names: &Names,
        ranks: &Ranks,
    ) -> Result<BTreeMap<DpRank, EngineLoad>, LoadError> {
        let running = self.counts(names.running, ranks)?;
        let waiting = self.counts(names.waiting, ranks)?;
        let mut extra: BTreeMap<DpRank, u64> = BTreeMap::new();
        for name in names.waiting_extra {
            for (rank, count) in self.counts(name, ranks)? {
                let sum = extra.entry(rank).or_default();
                *sum = sum.saturating_add(count);
            }
        }
        if running.is_empty() {
            return Err(self.missing(names.running.to_owned()));
        }
        if waiting.is_empty() {
            return Err(self.missing(names.waiting.to_owned()));
        }
        let rank_label = match ranks {
            Ranks::Single => "",
            Ranks::VllmEngine => "engine",
            Ranks::SglangDpRank => "dp_rank",
        };
        let lacking =
            |name: &str, rank: DpRank| self.missing(format!("{name}{{{rank_label}=\"{rank}\"}}"));
        if let Some(&rank) = waiting.keys().find(|r| !running.contains_key(r)) {
            return Err(lacking(names.running, rank));
        }
        running
            .into_iter()
            .map(|(rank, requests_running)| {
                let waiting = waiting
                    .get(&rank)
                    .ok_or_else(|| lacking(names.waiting, rank))?;
                let requests_waiting =
                    waiting.saturating_add(extra.get(&rank).copied().unwrap_or(0));
                Ok((
                    rank,
                    EngineLoad {
                        dp_rank: rank,
                        requests_running,
                        requests_waiting,
                        kv_used_blocks: None,
                        kv_total_blocks: None,
                    },
                ))
            })
            .collect()
    }

    /// The series of `name` per rank, as whole counts.
    fn counts(&self, name: &str, ranks: &Ranks) -> Result<BTreeMap<DpRank, u64>, LoadError> {
        let mut counts = BTreeMap::new();
        for (rank, sample, value) in self.series(name, ranks)? {
            let count = whole(value).ok_or_else(|| LoadError::InvalidValue {
                series: sample.to_string(),
                value: value.to_string(),
                url: self.url.to_owned(),
            })?;
            counts.insert(rank, count);
        }
        Ok(counts)
    }

    /// The value of `name` per rank, as read.
    /// The series of `name` per rank, or where the engine states none (or unreadable ones), of
    /// `older`, the name an older release gave it; empty when neither is readable (the KV
    /// figure is then unknown, which is not an error).
    fn values_or_older(&self, name: &str, older: &str, ranks: &Ranks) -> BTreeMap<DpRank, f64> {
        match self.values(name, ranks) {
            Ok(values) if !values.is_empty() => values,
            _ => self.values(older, ranks).unwrap_or_default(),
        }
    }

    fn values(&self, name: &str, ranks: &Ranks) -> Result<BTreeMap<DpRank, f64>, LoadError> {
        Ok(self
            .series(name, ranks)?
            .into_iter()
            .map(|(rank, _, value)| (rank, value))
            .collect())
    }

    /// One value per rank of metric `name`, sorted and combined as `ranks` says, with a sample
    /// of it to name in messages.
    fn series(
        &self,
        name: &str,
        ranks: &Ranks,
    ) -> Result<Vec<(DpRank, &Sample<'_>, f64)>, LoadError> {
        let mut out: BTreeMap<DpRank, (&Sample<'_>, f64, (u64, u64))> = BTreeMap::new();
        for sample in self.samples.iter().filter(|s| s.name == name) {
            match ranks {
                Ranks::Single => {
                    out.entry(0).and_modify(|e| e.1 += sample.value).or_insert((
                        sample,
                        sample.value,
                        (0, 0),
                    ));
                }
                Ranks::VllmEngine => {
                    let rank = self.rank(sample, "engine")?;
                    out.entry(rank)
                        .and_modify(|e| e.1 += sample.value)
                        .or_insert((sample, sample.value, (0, 0)));
                }
                Ranks::SglangDpRank => {
                    if sample.label("priority").is_some_and(|p| !p.is_empty()) {
                        continue;
                    }
                    let rank = self.rank(sample, "dp_rank")?;
                    let order = |label| {
                        sample
                            .label(label)
                            .and_then(|v| v.parse::<u64>().ok())
                            .unwrap_or(0)
                    };
                    let key = (order("pp_rank"), order("tp_rank"));
                    let entry = out.entry(rank).or_insert((sample, sample.value, key));
                    if key < entry.2 {
                        *entry = (sample, sample.value, key);
                    }
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|(rank, (sample, value, _))| (rank, sample, value))
            .collect())
    }

    /// The rank a sample's `label` names (0 when absent).
    fn rank(&self, sample: &Sample<'_>, label: &str) -> Result<DpRank, LoadError> {
        match sample.label(label) {
            None => Ok(0),
            Some(value) => value.parse().map_err(|_| LoadError::Malformed {
                url: self.url.to_owned(),
                message: format!(
                    "`{sample}` has {label}={value:?}; expected a data-parallel rank (a whole number)"
                ),
            }),
        }
    }

    /// `num_gpu_blocks` and `block_size` from `vllm:cache_config_info`, when it states them
    /// (`num_gpu_blocks` is `None` until the engine has profiled its memory).
    fn vllm_cache_info(&self) -> Option<CacheInfo> {
        let info = self
            .samples
            .iter()
            .find(|s| s.name == "vllm:cache_config_info")?;
        let number = |label| info.label(label)?.parse::<u64>().ok();
        Some(CacheInfo {
            num_gpu_blocks: number("num_gpu_blocks")?,
            block_size: NonZeroU32::new(u32::try_from(number("block_size")?).ok()?)?,
        })
    }

    fn missing(&self, metric: String) -> LoadError {
        LoadError::MissingMetric {
            url: self.url.to_owned(),
            metric,
        }
    }
}

struct CacheInfo {
    num_gpu_blocks: u64,
    block_size: NonZeroU32,
}

/// The largest value a count may have: every whole number up to it is exact in an `f64`.
const MAX_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53

/// `value` as a count: whole, at least 0 (a `-0.0` is 0), at most 2^53.
fn whole(value: f64) -> Option<u64> {
    if value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value <= MAX_EXACT {
        // Checked whole and in range just above.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(value as u64)
    } else {
        None
    }
}

/// vLLM's blocks in use from its usage fraction: `usage = 1 - free / (num_gpu_blocks - 1)`.
/// `None` when the fraction is not one (NaN, outside 0..=1) or the engine has no blocks.
fn blocks_in_use(usage: f64, num_gpu_blocks: u64) -> Option<u64> {
    let usable = num_gpu_blocks.checked_sub(1).filter(|&n| n > 0)?;
    if !(0.0..=1.0).contains(&usage) {
        return None;
    }
    #[allow(clippy::cast_precision_loss)]
    let used = (usage * usable as f64).round();
    whole(used).map(|used| used.min(usable))
}

/// `blocks` of `from` tokens each, as whole blocks of `to` tokens (rounded down: a capacity).
fn rebase_down(blocks: u64, from: NonZeroU32, to: NonZeroU32) -> u64 {
    blocks.saturating_mul(u64::from(from.get())) / u64::from(to.get())
}

/// `blocks` of `from` tokens each, as blocks of `to` tokens (rounded up).
fn rebase(blocks: u64, from: NonZeroU32, to: NonZeroU32) -> u64 {
    if from == to {
        return blocks;
    }
    blocks
        .saturating_mul(u64::from(from.get()))
        .div_ceil(u64::from(to.get()))
}

#[cfg(test)]
mod tests;
