//! Reading an engine's load into its worker's [`LoadReporter`] at an interval.

use std::time::Duration;

use anyhow::Context as _;
use kvroute_protocols::WorkerLoadReport;
use kvroute_runtime::LoadReporter;

/// The shortest interval an engine's load is read at (`kvroute worker --load-report-interval`,
/// a static fleet's `load_report_interval_ms`).
pub(crate) const MIN_LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(50);

/// The task reading the engine's load into a [`LoadReporter`]; stops when dropped.
pub(crate) struct LoadSampler(tokio::task::JoinHandle<()>);

impl Drop for LoadSampler {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the engine's load with `sample` every `interval` into `reporter`. A failed read is
/// logged (at WARN on the first of a streak) and clears the reports, so routers stop counting
/// on a stale figure; the next good read reports again.
pub(crate) fn spawn_load_sampler<F, Fut>(
    reporter: LoadReporter,
    interval: Duration,
    sample: F,
) -> LoadSampler
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<Vec<WorkerLoadReport>>> + Send,
{
    LoadSampler(tokio::spawn(async move {
        let mut failures = 0u32;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let reports = sample().await.and_then(|reports| {
                reports
                    .into_iter()
                    .try_for_each(|report| reporter.report(report))
                    .context("the engine's load does not make a valid report")
            });
            match reports {
                Ok(()) => {
                    if failures > 0 {
                        tracing::info!("the engine's load can be read again");
                    }
                    failures = 0;
                }
                Err(error) => {
                    failures += 1;
                    reporter.clear();
                    if failures == 1 {
                        tracing::warn!(error = %format!("{error:#}"), "cannot read the engine's load; not reporting it until it can be read");
                    } else {
                        tracing::debug!(error = %format!("{error:#}"), failures, "still cannot read the engine's load");
                    }
                }
            }
        }
    }))
}
