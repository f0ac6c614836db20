//! The bench's output: a line per run while it goes, and the markdown tables at the end (a
//! summary matrix per fleet size, every figure of every cell, kvroute's predicted against the
//! engines' reported hit rate, and the errors).

use std::fmt::Write as _;

use anyhow::{Result, bail};

use super::{Args, EngineKind, Results, Run};

pub(super) fn run_summary(run: &Run) -> String {
    if let Some(e) = &run.failed {
        return format!("FAILED: {}", first_line(e));
    }
    let f = &run.figures;
    let mut out = format!(
        "{}/{} ok, hit {} (engines {}), TTFT p50/p99 {}/{} ms, CPU {} s/1k, RSS {} MiB",
        f.ok,
        f.requests,
        pct(f.hit_rate_usage),
        pct(f.hit_rate_engines),
        num(f.ttft_p50_ms, 1),
        num(f.ttft_p99_ms, 1),
        num(f.cpu_s_per_1k, 2),
        num(f.peak_rss_mib, 0),
    );
    if let (Some(client), Some(engines)) = (f.ttft_mean_ms, f.engine_ttft_mean_ms) {
        let _ = write!(
            out,
            ", TTFT mean {client:.1} ms (at the engines {engines:.1})"
        );
    }
    if let Some(p) = run.predicted {
        let _ = write!(out, ", predicted {}", pct(Some(p)));
    }
    if let Some(f) = run.forgone {
        let _ = write!(out, ", forgone {}", pct(Some(f)));
    }
    if let Some(t) = run.tokenizing_s_per_1k {
        let _ = write!(out, ", tokenizing {t:.2} s/1k");
        if let Some(encoder) = &run.encoder {
            let _ = write!(out, " ({encoder})");
        }
    }
    if let Some(e) = &f.first_error {
        let _ = write!(out, "; first error: {}", first_line(e));
    }
    out
}

/// The first line of an error, and its last when it ends in a log tail (what the process said
/// last).
fn first_line(text: &str) -> String {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or_default();
    match lines.next_back() {
        Some(last) => format!("{first} … {}", last.trim()),
        None => first.to_owned(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// The mean over a cell's successful runs of one figure.
fn mean<'a>(
    runs: impl IntoIterator<Item = &'a Run>,
    figure: impl Fn(&Run) -> Option<f64>,
) -> Option<f64> {
    let values: Vec<f64> = runs
        .into_iter()
        .filter(|r| r.failed.is_none())
        .filter_map(figure)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// What the runs were: the report's first paragraph.
fn preamble(args: &Args) -> String {
    let kvroute_args = if args.kvroute_args.is_empty() {
        String::new()
    } else {
        format!("; kvroute serve given `{}`", args.kvroute_args.join(" "))
    };
    let kvroute_args = if args.pin {
        format!(
            "{kvroute_args}; each router pinned to the last core, the fleet and the load to the others"
        )
    } else {
        kvroute_args
    };
    match args.engine {
        EngineKind::Sim => format!(
            "\nkvroute bench peers: workload scale {}, token scale {}, speed-up {}x, {} s of each \
             trace, seed {}, {} round(s); latencies in real milliseconds (multiply by the speed-up \
             for the modelled H100's); figures are means over rounds{kvroute_args}. The ceiling is \
             the share of prompt tokens an earlier request of the run had sent: the hit rate of a \
             router that always found a prompt's longest cached prefix on engines that evicted \
             nothing.\n\n",
            args.workloads
                .iter()
                .map(|w| format!("{w} {}", args.scale(w)))
                .collect::<Vec<_>>()
                .join(", "),
            args.token_scale,
            args.speedup,
            args.duration,
            args.seed,
            args.rounds,
        ),
        EngineKind::Llamacpp => {
            let s = args.sizing();
            format!(
                "\nkvroute bench peers --engine llamacpp: real llama.cpp servers (the tiny test \
                 model, CPU, one slot each, --slot-prompt-similarity 0, fresh per run); {} \
                 families of {} conversations sharing the family's system prompt, {} streamed \
                 turns each ({} requests, replies cut at {} tokens and appended to the history), \
                 {} closed-loop clients, seed {}, {} round(s); hit rates from each response's \
                 `usage.prompt_tokens_details.cached_tokens` and, as a check, from the engines' \
                 counters (`llamacpp:prompt_tokens_cached_total` over it plus \
                 `llamacpp:prompt_tokens_total`); latencies in milliseconds; figures are means \
                 over rounds{kvroute_args}. vLLM router 0.1.17 extracts no \
                 text from chat bodies: its cache_aware routes these chats on load alone; \
                 `(text)` sends it the same conversations as /v1/completions prompts (the \
                 messages rendered with the model's ChatML template: the same tokens).\n\n",
                s.families,
                s.per_family,
                s.turns,
                s.requests(),
                s.max_tokens,
                s.clients,
                args.seed,
                args.rounds,
            )
        }
    }
}

/// The markdown report: a summary matrix per fleet size (hit rate and TTFT p99 per workload
/// and configuration), then every figure of every cell. Each trace row shows its ceiling ([`super::load::ceiling_hit_rate`]) beside its name.
pub(super) fn report(args: &Args, results: &Results) -> String {
    let mut out = preamble(args);
    for &engines in &args.engines {
        let _ = writeln!(
            out,
            "### {engines} engines: engine-reported hit rate / TTFT p99 (ms)\n"
        );
        let _ = write!(out, "| workload | ceiling |");
        for config in &args.routers {
            let _ = write!(out, " {} |", config.label());
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "|---|---|{}", "---|".repeat(args.routers.len()));
        for workload in args.rows() {
            let workload = workload.label();
            let cell = results.get(&(engines, workload.clone()));
            // Every configuration's runs of the row served the same requests.
            let all_runs = cell.into_iter().flat_map(|c| c.values().flatten());
            let ceiling = pct(mean(all_runs, |r| r.figures.ceiling));
            let _ = write!(out, "| {workload} | {ceiling} |");
            for config in &args.routers {
                let runs = cell
                    .and_then(|c| c.get(config))
                    .map_or(&[][..], Vec::as_slice);
                let _ = write!(
                    out,
                    " {} / {} |",
                    pct(mean(runs, |r| r.figures.hit_rate_usage)),
                    num(mean(runs, |r| r.figures.ttft_p99_ms), 1)
                );
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "### Every figure\n");
    let _ = writeln!(
        out,
        "| engines | workload | router | ok / requests | hit (usage) | hit (engine counters) | \
         kvroute predicted | kvroute forgone | TTFT mean (at the engines) | TTFT p50 | TTFT p99 | E2E p99 | output tok/s | router CPU s / 1k req \
         | kvroute tokenizing s / 1k req | router peak RSS MiB |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for ((engines, workload), cell) in results {
        for (config, runs) in cell {
            let ok: usize = runs.iter().map(|r| r.figures.ok).sum();
            let requests: usize = runs.iter().map(|r| r.figures.requests).sum();
            let failed = runs.iter().filter(|r| r.failed.is_some()).count();
            let status = if failed > 0 {
                format!("{ok} / {requests} ({failed} run(s) failed to start)")
            } else {
                format!("{ok} / {requests}")
            };
            let _ = writeln!(
                out,
                "| {engines} | {workload} | {} | {status} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} |",
                config.label(),
                pct(mean(runs, |r| r.figures.hit_rate_usage)),
                pct(mean(runs, |r| r.figures.hit_rate_engines)),
                pct(mean(runs, |r| r.predicted)),
                pct(mean(runs, |r| r.forgone)),
                num(mean(runs, |r| r.figures.ttft_mean_ms), 1),
                num(mean(runs, |r| r.figures.engine_ttft_mean_ms), 1),
                num(mean(runs, |r| r.figures.ttft_p50_ms), 1),
                num(mean(runs, |r| r.figures.ttft_p99_ms), 1),
                num(mean(runs, |r| r.figures.e2e_p99_ms), 1),
                num(mean(runs, |r| Some(r.figures.output_tokens_per_s)), 0),
                num(mean(runs, |r| r.figures.cpu_s_per_1k), 2),
                num(mean(runs, |r| r.tokenizing_s_per_1k), 2),
                num(mean(runs, |r| r.figures.peak_rss_mib), 0),
            );
        }
    }
    let failures: Vec<String> = results
        .iter()
        .flat_map(|((engines, workload), cell)| {
            cell.iter().flat_map(move |(config, runs)| {
                runs.iter().filter_map(move |r| {
                    let why = r.failed.as_deref().or(r.figures.first_error.as_deref())?;
                    Some(format!(
                        "- {engines} engines, {workload}, {}: {}",
                        config.label(),
                        first_line(why)
                    ))
                })
            })
        })
        .collect();
    let gaps: Vec<String> = results
        .iter()
        .flat_map(|((engines, workload), cell)| {
            cell.iter().filter_map(move |(config, runs)| {
                let predicted = mean(runs, |r| r.predicted)?;
                let reported = mean(runs, |r| r.figures.hit_rate_usage)?;
                Some(format!(
                    "- {engines} engines, {workload}, {}: predicted {}, reported {}, predicted \
                     minus reported {:+.3}",
                    config.label(),
                    pct(Some(predicted)),
                    pct(Some(reported)),
                    predicted - reported
                ))
            })
        })
        .collect();
    if !gaps.is_empty() {
        let _ = writeln!(
            out,
            "\nkvroute's predicted hit rate against the engines' report (means over rounds):\n"
        );
        for g in gaps {
            let _ = writeln!(out, "{g}");
        }
    }
    if !failures.is_empty() {
        let _ = writeln!(out, "\nErrors (first of each run):\n");
        for f in failures {
            let _ = writeln!(out, "{f}");
        }
    }
    out
}

/// `--quick`: every configuration ran and served every request.
pub(super) fn check_quick(results: &Results) -> Result<()> {
    let mut problems = Vec::new();
    for ((engines, workload), cell) in results {
        for (config, runs) in cell {
            for run in runs {
                if let Some(e) = &run.failed {
                    problems.push(format!(
                        "{}: did not run: {}",
                        config.label(),
                        first_line(e)
                    ));
                } else if run.figures.ok != run.figures.requests || run.figures.requests == 0 {
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: served {} of {} requests{}",
                        config.label(),
                        run.figures.ok,
                        run.figures.requests,
                        run.figures
                            .first_error
                            .as_deref()
                            .map(|e| format!(" (first error: {})", first_line(e)))
                            .unwrap_or_default()
                    ));
                } else if run.figures.ceiling.is_some() && run.figures.engine_ttft_mean_ms.is_none()
                {
                    // A trace run (the only kind with a ceiling) is on the simulated fleet, whose
                    // engines publish vLLM's time-to-first-token histogram.
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: the engines' metrics gave no \
                         vllm:time_to_first_token_seconds",
                        config.label()
                    ));
                } else if config.is_kvroute() && run.tokenizing_s_per_1k.is_none() {
                    // Every prompt the bench sends is text, so kvroute tokenized each one.
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: its metrics showed no tokenizing \
                         time",
                        config.label()
                    ));
                } else if config.is_kvroute() && run.forgone.is_none() {
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: its metrics showed no \
                         forgone_cached_tokens_total or input_tokens_total",
                        config.label()
                    ));
                } else if config.is_kvroute() && run.encoder.as_deref() != Some("fastokens") {
                    // Both of the bench's tokenizers are BPEs that fastokens encodes.
                    problems.push(format!(
                        "{} on {engines} engines, {workload}: its prompts were encoded by {}, \
                         expected fastokens",
                        config.label(),
                        run.encoder
                            .as_deref()
                            .unwrap_or("an encoder its metrics do not name")
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        bail!("bench peers --quick:\n  {}", problems.join("\n  "));
    }
    Ok(())
}
