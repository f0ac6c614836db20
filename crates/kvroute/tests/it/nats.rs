//! Several routers over one fleet through NATS: 3 `kvroute serve --nats` and 6 `kvroute worker
//! --mock --nats` processes on one throwaway `nats-server -js`. Every router indexes every
//! worker's KV events from JetStream, a restarted router catches up, and load drains to zero
//! on every router. All waits are bounded; every child is killed when the test ends.

use std::time::Duration;

use kvroute_nats::testing::NatsServer;
use serde_json::{Value, json};

use crate::e2e::{BOUND, Proc, active_requests, chat_body, conversation, decode_worker, gauge};
use crate::support::scratch;

const WORKERS: u64 = 6;

struct Router {
    proc: Proc,
    base: String,
}

fn start_router(url: &str, dir: &std::path::Path, name: &str) -> Router {
    let proc = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nats",
            url,
            "--lease-ttl",
            "2s",
            "--snapshot-interval",
            "1s",
        ],
        &dir.join(format!("{name}.log")),
    );
    assert_eq!(proc.field("registry"), "nats");
    let base = format!("http://{}", proc.field("http"));
    Router { proc, base }
}

async fn metrics(http: &reqwest::Client, router: &Router) -> String {
    http.get(format!("{}/metrics", router.base))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body")
}

/// Polls `router`'s `/metrics` until `condition` holds (bounded).
async fn eventually(
    http: &reqwest::Client,
    router: &Router,
    what: &str,
    condition: impl Fn(&str) -> bool,
) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let text = metrics(http, router).await;
        if condition(&text) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} did not happen on {}; metrics:\n{text}",
            router.base
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn chat(http: &reqwest::Client, router: &Router, body: &Value) -> Value {
    let response = http
        .post(format!("{}/v1/chat/completions", router.base))
        .json(body)
        .send()
        .await
        .expect("POST");
    let status = response.status().as_u16();
    let json: Value = response.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 200, "{json}");
    json
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_routers_share_the_fleets_kv_events_and_a_restarted_router_catches_up() {
    let mut server = NatsServer::start();
    let url = server.url();
    let dir = scratch("nats-three-routers");
    let mut routers: Vec<Router> = ["a", "b", "c"]
        .iter()
        .map(|name| start_router(&url, &dir, name))
        .collect();
    let workers: Vec<Proc> = (1..=WORKERS)
        .map(|id| {
            let id = id.to_string();
            Proc::start(
                &[
                    "worker",
                    "--mock",
                    "--id",
                    &id,
                    "--nats",
                    &url,
                    "--lease-ttl",
                    "2s",
                    "--speedup",
                    "100",
                    "--metrics-listen",
                    "127.0.0.1:0",
                ],
                &dir.join(format!("worker-{id}.log")),
            )
        })
        .collect();
    let http = reqwest::Client::builder().timeout(BOUND).build().unwrap();
    for router in &routers {
        eventually(&http, router, "every worker listed", |m| {
            (1..=WORKERS).all(|w| active_requests(m, w).is_some())
        })
        .await;
    }
    let want = json!({"extra_fields": ["worker_id"]});
    // Router A serves the first turn of each conversation; its worker's KV events reach B and
    // C through JetStream, so they send the conversation's next turn to the same worker and
    // predict cached tokens for prompts they never routed.
    let mut homes = Vec::new();
    for c in 0..4 {
        let first = chat(
            &http,
            &routers[0],
            &chat_body(conversation(c, 1), 4, want.clone()),
        )
        .await;
        homes.push(decode_worker(&first));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (r, router) in routers.iter().enumerate().skip(1) {
        let before = counter(
            &metrics(&http, router).await,
            "kvroute_router_predicted_cached_tokens",
        );
        for (c, home) in homes.iter().enumerate() {
            let later = chat(
                &http,
                router,
                &chat_body(conversation(c, 2), 4, want.clone()),
            )
            .await;
            assert_eq!(
                decode_worker(&later),
                *home,
                "router {r} sent conversation {c}'s second turn away from the worker holding its prefix"
            );
        }
        let after = counter(
            &metrics(&http, router).await,
            "kvroute_router_predicted_cached_tokens",
        );
        assert!(
            after > before,
            "router {r} predicted no cached tokens for prefixes only router 0 routed"
        );
    }
    // A session opened through router A is honoured by B and C, for prompts no cache pulls
    // anywhere, and its engine session is opened once and closed once, by whichever router
    // handles the close.
    for s in 0..3 {
        let session = format!("shared-{s}");
        let open = json!({"extra_fields": ["worker_id"],
            "session_control": {"session_id": session, "action": "open", "timeout": 60}});
        let opened = chat(
            &http,
            &routers[0],
            &chat_body(conversation(100 + s, 1), 4, open),
        )
        .await;
        let home = decode_worker(&opened);
        tokio::time::sleep(Duration::from_millis(300)).await;
        for (r, router) in routers.iter().enumerate().skip(1) {
            let next =
                json!({"extra_fields": ["worker_id"], "session_control": {"session_id": session}});
            let turn = chat(
                &http,
                router,
                &chat_body(conversation(200 + 10 * s + r, 1), 4, next),
            )
            .await;
            assert_eq!(
                decode_worker(&turn),
                home,
                "router {r} did not honour session {session} bound through router 0"
            );
        }
        let close = json!({"extra_fields": ["worker_id"],
            "session_control": {"session_id": session, "action": "close"}});
        let closed = chat(
            &http,
            &routers[2],
            &chat_body(conversation(300 + s, 1), 4, close),
        )
        .await;
        assert_eq!(decode_worker(&closed), home);
        let worker_metrics = &workers[home as usize - 1];
        let url = format!("http://{}/metrics", worker_metrics.field("metrics"));
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            let text = http.get(&url).send().await.unwrap().text().await.unwrap();
            let opens = counter(&text, "kvroute_worker_session_opens_total");
            let closes = counter(&text, "kvroute_worker_session_closes_total");
            let open_now = counter(&text, "kvroute_worker_sessions_open");
            if closes >= opens && open_now == 0.0 {
                assert!(
                    opens >= 1.0,
                    "no session was opened on worker {home}:\n{text}"
                );
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "session {session} was not closed once on worker {home}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut total_opens = 0.0;
    let mut total_closes = 0.0;
    for worker in &workers {
        let url = format!("http://{}/metrics", worker.field("metrics"));
        let text = http.get(&url).send().await.unwrap().text().await.unwrap();
        total_opens += counter(&text, "kvroute_worker_session_opens_total");
        total_closes += counter(&text, "kvroute_worker_session_closes_total");
    }
    assert_eq!(
        (total_opens, total_closes),
        (3.0, 3.0),
        "each engine session opened and closed once"
    );

    // NATS goes away for longer than the lease TTL: every router keeps routing on what it
    // knows (no worker is dropped, no request fails), says so in /metrics, and resyncs.
    server.stop();
    for router in &routers {
        eventually(&http, router, "the NATS outage shows in /metrics", |m| {
            m.contains("kvroute_nats_connected 0")
        })
        .await;
    }
    for round in 0..2 {
        for (r, router) in routers.iter().enumerate() {
            let body = chat_body(conversation(400 + 10 * round + r, 1), 4, want.clone());
            chat(&http, router, &body).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    server.restart();
    for router in &routers {
        eventually(&http, router, "the NATS connection is back", |m| {
            m.contains("kvroute_nats_connected 1")
                && (1..=WORKERS).all(|w| active_requests(m, w).is_some())
        })
        .await;
    }
    for (c, home) in homes.iter().enumerate() {
        let later = chat(
            &http,
            &routers[2],
            &chat_body(conversation(c, 3), 4, want.clone()),
        )
        .await;
        assert_eq!(
            decode_worker(&later),
            *home,
            "after the outage, conversation {c} moved"
        );
    }

    // Router B dies and comes back: it loads the shared index snapshot, reads the events after
    // it from the stream (asking no worker for a dump), and routes as before.
    let dumps = || async {
        let mut total = 0.0;
        for worker in &workers {
            let url = format!("http://{}/metrics", worker.field("metrics"));
            let text = http.get(&url).send().await.unwrap().text().await.unwrap();
            total += counter(&text, "kvroute_worker_kv_dumps_total");
        }
        total
    };
    let dumps_before = dumps().await;
    // Replicas take turns: any of them may have saved it.
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let mut saved = 0.0;
        for router in &routers {
            saved += counter(
                &metrics(&http, router).await,
                "kvroute_router_snapshots_saved",
            );
        }
        if saved > 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no router saved an index snapshot"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    routers[1].proc.kill();
    routers[1] = start_router(&url, &dir, "b-restarted");
    eventually(
        &http,
        &routers[1],
        "every worker listed after the restart",
        |m| (1..=WORKERS).all(|w| active_requests(m, w).is_some()),
    )
    .await;
    for (c, home) in homes.iter().enumerate() {
        let later = chat(
            &http,
            &routers[1],
            &chat_body(conversation(c, 3), 4, want.clone()),
        )
        .await;
        assert_eq!(
            decode_worker(&later),
            *home,
            "the restarted router sent conversation {c} away from the worker holding its prefix"
        );
    }
    let text = metrics(&http, &routers[1]).await;
    assert!(
        counter(&text, "kvroute_router_predicted_cached_tokens") > 0.0,
        "the restarted router predicted no cached tokens:\n{text}"
    );
    assert!(
        counter(&text, "kvroute_router_snapshot_restored_blocks") > 0.0,
        "the restarted router restored no snapshot:\n{text}"
    );
    assert_eq!(
        dumps().await,
        dumps_before,
        "the restarted router asked workers for dumps instead of using the snapshot and stream"
    );
    assert!(text.contains("kvroute_nats_connected 1"), "{text}");
    for router in &routers {
        // The workers' own reports travel on NATS too, and agree.
        eventually(&http, router, "zero load on every worker", |m| {
            (1..=WORKERS).all(|w| {
                active_requests(m, w) == Some(0)
                    && gauge(m, "worker_reported_requests", w) == Some(0.0)
            })
        })
        .await;
    }
    drop(server);
}

/// `--registry-listen` beside `--nats`: workers that register with router A over the request
/// plane are registered in NATS by A and their KV events bridged to JetStream, so router B,
/// which only knows NATS, serves them too and follows their caches; when A stops, they leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routers_own_registry_serves_its_workers_to_every_replica() {
    let server = NatsServer::start();
    let url = server.url();
    let dir = scratch("nats-registry-beside");
    let a = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nats",
            &url,
            "--registry-listen",
            "127.0.0.1:0",
            "--lease-ttl",
            "2s",
        ],
        &dir.join("a.log"),
    );
    let registry = a.field("registry").to_owned();
    assert_ne!(registry, "nats", "router A listens for registrations");
    let a = Router {
        base: format!("http://{}", a.field("http")),
        proc: a,
    };
    let b = start_router(&url, &dir, "b");
    let _workers: Vec<Proc> = (1..=2u64)
        .map(|id| {
            let id = id.to_string();
            Proc::start(
                &[
                    "worker",
                    "--mock",
                    "--id",
                    &id,
                    "--router",
                    &registry,
                    "--speedup",
                    "100",
                ],
                &dir.join(format!("worker-{id}.log")),
            )
        })
        .collect();
    let http = reqwest::Client::builder().timeout(BOUND).build().unwrap();
    for router in [&a, &b] {
        eventually(&http, router, "both workers listed", |m| {
            (1..=2).all(|w| active_requests(m, w).is_some())
        })
        .await;
    }
    let want = json!({"extra_fields": ["worker_id"]});
    let mut homes = Vec::new();
    for c in 0..4 {
        let first = chat(&http, &a, &chat_body(conversation(c, 1), 4, want.clone())).await;
        homes.push(decode_worker(&first));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (c, home) in homes.iter().enumerate() {
        let later = chat(&http, &b, &chat_body(conversation(c, 2), 4, want.clone())).await;
        assert_eq!(
            decode_worker(&later),
            *home,
            "router B sent conversation {c} away from the worker holding its prefix"
        );
    }
    let text = metrics(&http, &b).await;
    assert!(
        counter(&text, "kvroute_router_predicted_cached_tokens") > 0.0,
        "router B predicted no cached tokens for the registry's workers:\n{text}"
    );
    for router in [&a, &b] {
        // Router A bridges the workers' load reports to NATS as well, where B reads them.
        eventually(&http, router, "zero load", |m| {
            (1..=2).all(|w| {
                active_requests(m, w) == Some(0)
                    && gauge(m, "worker_reported_requests", w) == Some(0.0)
            })
        })
        .await;
    }
    // Router A goes: the registrations it made lapse, and B stops listing the workers.
    let Router { mut proc, .. } = a;
    proc.kill();
    eventually(&http, &b, "the registry's workers gone with it", |m| {
        (1..=2).all(|w| active_requests(m, w).is_none())
    })
    .await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_worker_started_before_nats_wait_for_it() {
    let mut server = NatsServer::start();
    let url = server.url();
    // NATS is not up yet when the router and the worker start.
    server.stop();
    let dir = scratch("nats-started-late");
    let router = {
        let (url, dir) = (url.clone(), dir.clone());
        std::thread::spawn(move || start_router(&url, &dir, "router"))
    };
    let worker = {
        let (url, dir) = (url.clone(), dir.clone());
        std::thread::spawn(move || {
            Proc::start(
                &[
                    "worker",
                    "--mock",
                    "--id",
                    "1",
                    "--nats",
                    &url,
                    "--speedup",
                    "100",
                ],
                &dir.join("worker.log"),
            )
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    server.restart();
    let router = router.join().expect("the router waited for NATS");
    let _worker = worker.join().expect("the worker waited for NATS");
    let http = reqwest::Client::builder().timeout(BOUND).build().unwrap();
    eventually(&http, &router, "the worker is listed", |m| {
        active_requests(m, 1).is_some()
    })
    .await;
    let health = http
        .get(format!("{}/health", router.base))
        .send()
        .await
        .expect("GET /health");
    assert!(health.status().is_success(), "{health:?}");
    let log = std::fs::read_to_string(dir.join("worker.log")).unwrap_or_default();
    assert!(
        log.contains("not reachable yet") && log.contains("attempt"),
        "each retry is logged: {log}"
    );

    // A URL that is not a NATS address fails at once.
    for bad in ["http://127.0.0.1:4222", "nats://[::1"] {
        let started = std::time::Instant::now();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["worker", "--mock", "--nats", bad])
            .output()
            .expect("run kvroute");
        assert!(!output.status.success());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{bad}: took {:?}",
            started.elapsed()
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("invalid NATS URL"), "{bad}: {stderr}");
    }
}

/// A NATS server that requires a password: the router and the worker pass it in the URL and
/// serve; a wrong one stops either process at once with the server's refusal, never a minute of
/// retries, and the password appears in no log or error (issue 34).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_password_in_the_url_is_used_and_a_wrong_one_fails_at_once_without_leaking() {
    const SECRET: &str = "n4ts-s3cret";
    let server = NatsServer::start_with(&["--user", "fleet", "--pass", SECRET]);
    let good = server
        .url()
        .replacen("nats://", &format!("nats://fleet:{SECRET}@"), 1);
    let dir = scratch("nats-password");
    let router = start_router(&good, &dir, "router");
    let _worker = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "1",
            "--nats",
            &good,
            "--speedup",
            "100",
        ],
        &dir.join("worker.log"),
    );
    let http = reqwest::Client::builder().timeout(BOUND).build().unwrap();
    eventually(&http, &router, "the worker is listed", |m| {
        active_requests(m, 1).is_some()
    })
    .await;

    let wrong = server
        .url()
        .replacen("nats://", "nats://fleet:not-the-password@", 1);
    for args in [
        vec!["worker", "--mock", "--id", "2", "--nats", &wrong],
        vec!["serve", "--listen", "127.0.0.1:0", "--nats", &wrong],
    ] {
        let started = std::time::Instant::now();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(&args)
            .output()
            .expect("run kvroute");
        assert!(!output.status.success(), "{args:?}");
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{args:?}: a refusal is not retried ({:?})",
            started.elapsed()
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("refused the connection"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains("fleet:***@"), "{args:?}: {stderr}");
        assert!(!stderr.contains("not-the-password"), "{args:?}: {stderr}");
    }
    for log in ["router.log", "worker.log"] {
        let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
        assert!(!text.contains(SECRET), "the NATS password is in {log}");
    }
}

/// With a fleet secret over NATS, a registration that does not prove it is never listed (anyone
/// on the NATS server can write one), while a worker holding the secret serves (issue 34).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_nats_only_registrations_proving_the_fleet_secret_are_served() {
    let server = NatsServer::start();
    let url = server.url();
    let dir = scratch("nats-fleet-secret");
    let secret = dir.join("fleet-secret");
    std::fs::write(&secret, "nats-fleet-secret-0123456789\n").unwrap();
    let secret = secret.to_str().unwrap().to_owned();
    let proc = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nats",
            &url,
            "--fleet-secret-file",
            &secret,
        ],
        &dir.join("router.log"),
    );
    let router = Router {
        base: format!("http://{}", proc.field("http")),
        proc,
    };
    let _member = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "1",
            "--nats",
            &url,
            "--speedup",
            "100",
            "--fleet-secret-file",
            &secret,
        ],
        &dir.join("member.log"),
    );
    let _stranger = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "2",
            "--nats",
            &url,
            "--speedup",
            "100",
        ],
        &dir.join("stranger.log"),
    );
    let http = reqwest::Client::builder().timeout(BOUND).build().unwrap();
    eventually(&http, &router, "the member is listed", |m| {
        active_requests(m, 1).is_some()
    })
    .await;
    // Give the stranger's registration time to be seen (it registered at start).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics = metrics(&http, &router).await;
    assert!(
        active_requests(&metrics, 2).is_none(),
        "the stranger is listed: {metrics}"
    );
    let body = chat(
        &http,
        &router,
        &chat_body(
            conversation(0, 1),
            2,
            json!({"extra_fields": ["worker_id"]}),
        ),
    )
    .await;
    assert_eq!(decode_worker(&body), 1, "{body}");
    let log = std::fs::read_to_string(dir.join("router.log")).unwrap_or_default();
    assert!(
        log.contains("ignoring a registration without a valid proof of the fleet secret"),
        "{log}"
    );
}
