//! Client authentication end to end: `kvroute serve --api-key-file` in front of mock workers,
//! called with the stock `openai` client (which always sends a key): with a wrong one, the SDK raises its
//! `AuthenticationError` (401, not retried); with the key, completions and chat stream; a SIGHUP
//! reloads the file; no key appears in the router's log. And fleet membership: only workers
//! holding the fleet secret join.

use std::process::Command;
use std::time::Duration;

use crate::e2e::{Fleet, Proc};
use crate::llamacpp::python;
use crate::support::scratch;

const KEY: &str = "sk-e2e-secret-7f3a9c";
const ROTATED: &str = "sk-e2e-rotated-1b2d4e";

/// The client side, with the stock SDK: prints one line per check.
const CLIENT: &str = r#"
import sys, openai
base, key, other = sys.argv[1], sys.argv[2], sys.argv[3]
def client(k):
    return openai.OpenAI(base_url=base + "/v1", api_key=k, max_retries=0, timeout=30)
for name, k in [("garbage", "not-a-key"), ("wrong", other)]:
    try:
        client(k).completions.create(model="mock", prompt="hello", max_tokens=2)
        print(name, "served")
    except openai.AuthenticationError as e:
        print(name, "401", e.status_code, e.body.get("code") if isinstance(e.body, dict) else e.body)
c = client(key)
r = c.completions.create(model="mock", prompt="hello there", max_tokens=3)
print("key completion", r.choices[0].finish_reason, r.usage.completion_tokens)
text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
    model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
    if ch.choices)
print("key stream", len(text) > 0)
"#;

/// Runs the Python `script` with `args`; its standard output (a failure shows both streams).
fn run_script(python: &str, script: &str, args: &[&str]) -> String {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run the openai client");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn run_client(python: &str, base: &str, key: &str, other: &str) -> String {
    run_script(python, CLIENT, &[base, key, other])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_client_needs_a_configured_key_and_a_sighup_rotates_it() {
    let python = python();
    let dir = scratch("security-api-keys");
    let keys = dir.join("api-keys");
    std::fs::write(&keys, format!("# clients\n{KEY}\n")).unwrap();
    let keys_arg = keys.to_str().unwrap().to_owned();
    let fleet = Fleet::start("security", &["--api-key-file", &keys_arg], "50").await;

    let out = run_client(&python, &fleet.base, KEY, ROTATED);
    for line in [
        "garbage 401 401 invalid_api_key",
        "wrong 401 401 invalid_api_key",
        "key completion length 3",
        "key stream True",
    ] {
        assert!(out.contains(line), "expected `{line}` in:\n{out}");
    }

    // Rotation without a restart: the new key works, the old one no longer does.
    std::fs::write(&keys, format!("{ROTATED}\n")).unwrap();
    let pid = fleet.serve.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = run_client(&python, &fleet.base, ROTATED, KEY);
        if out.contains("wrong 401") && out.contains("key completion length 3") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rotated key was not accepted after SIGHUP:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let metrics = fleet.router_metrics().await;
    assert!(
        metrics.contains("kvroute_router_http_auth_total{outcome=\"invalid\"}"),
        "{metrics}"
    );
    drop(fleet);
    let log = std::fs::read_to_string(dir.parent().unwrap().join("e2e-security/serve.log"))
        .unwrap_or_default();
    assert!(log.contains("reloaded the client API keys"), "{log}");
    for secret in [KEY, ROTATED] {
        assert!(!log.contains(secret), "a key reached the router's log");
    }
}

/// Fleet membership: with `--fleet-secret-file` on `serve`, a worker holding the same file joins
/// and serves; one without it is refused at registration (it exits saying why, the router logs
/// its address) and never receives a request; the secret reaches no log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_workers_holding_the_fleet_secret_join_and_receive_requests() {
    const SECRET: &str = "fleet-secret-e2e-5a8c1d9b";
    let dir = scratch("security-fleet-secret");
    let file = dir.join("fleet-secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let file = file.to_str().unwrap().to_owned();
    let serve = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--fleet-secret-file",
            &file,
        ],
        &dir.join("serve.log"),
    );
    let registry = serve.field("registry").to_owned();
    let base = format!("http://{}", serve.field("http"));
    let _member = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "1",
            "--router",
            &registry,
            "--speedup",
            "100",
            "--fleet-secret-file",
            &file,
        ],
        &dir.join("member.log"),
    );

    // A worker without the secret is refused at once and says why.
    let stranger = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["worker", "--mock", "--id", "2", "--router", &registry])
        .output()
        .expect("run kvroute worker");
    assert!(!stranger.status.success());
    let stderr = String::from_utf8_lossy(&stranger.stderr);
    assert!(stderr.contains("fleet secret"), "{stderr}");

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let body = serde_json::json!({
        "model": "mock", "prompt": "hello", "max_tokens": 2,
        "nvext": {"extra_fields": ["worker_id"]}
    });
    loop {
        let resp = http
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            let json: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(json["nvext"]["worker_id"]["decode_worker_id"], 1, "{json}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the member never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains("worker=\"2\""),
        "the stranger is listed: {metrics}"
    );
    drop(serve);
    let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
    assert!(
        log.contains("refused a request-plane connection without the fleet secret")
            && log.contains("127.0.0.1:"),
        "the refusal is logged with the peer: {log}"
    );
    for name in ["serve.log", "member.log"] {
        let text = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        assert!(!text.contains(SECRET), "the fleet secret is in {name}");
    }
    assert!(!stderr.contains(SECRET));
}

/// Writes a test CA and a certificate for 127.0.0.1/localhost signed by it; returns the CA's,
/// the leaf's and the leaf key's paths.
fn test_pki(dir: &std::path::Path, name: &str) -> (String, String, String) {
    let (ca, mut certs) = fleet_pki(dir, name, &[&["127.0.0.1", "localhost"]]);
    let (cert, key) = certs.remove(0);
    (ca, cert, key)
}

/// The stock client over HTTPS, trusting `ca`: a completion and a streamed chat.
const TLS_CLIENT: &str = r#"
import sys, openai
base, ca = sys.argv[1], sys.argv[2]
# The SDK's own HTTP client, trusting only the test's CA.
c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30,
                  http_client=openai.DefaultHttpx2Client(verify=ca))
try:
    r = c.completions.create(model="mock", prompt="hello there", max_tokens=3)
    print("completion", r.choices[0].finish_reason)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
        if ch.choices)
    print("stream", len(text) > 0)
except openai.APIConnectionError as e:
    print("untrusted", type(e.__cause__).__name__)
except openai.APIStatusError as e:
    print("status", e.status_code)
"#;

fn tls_client(python: &str, base: &str, ca: &str) -> String {
    run_script(python, TLS_CLIENT, &[base, ca])
}

/// HTTPS: `serve --tls-cert/--tls-key` answers the stock client trusting the test CA (whole and
/// streamed), a client trusting another CA cannot connect, and a SIGHUP swaps in a new
/// certificate without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_client_talks_https_to_a_router_with_a_certificate_its_ca_signed() {
    let python = python();
    let dir = scratch("security-tls");
    let (ca, cert, key) = test_pki(&dir, "first");
    let (other_ca, other_cert, other_key) = test_pki(&dir, "second");
    let serve = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
        &dir.join("serve.log"),
    );
    let registry = serve.field("registry").to_owned();
    let https = format!("https://{}", serve.field("http"));
    let _worker = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "1",
            "--router",
            &registry,
            "--speedup",
            "100",
        ],
        &dir.join("worker.log"),
    );
    // Until the worker is listed the router answers 503, which the client reports.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = tls_client(&python, &https, &ca);
        if out.contains("completion length") {
            assert!(out.contains("stream True"), "{out}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never served over HTTPS: {out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = tls_client(&python, &https, &other_ca);
    assert!(out.contains("untrusted"), "{out}");

    // Renewal: the files change, a SIGHUP reloads them; new connections get the new one.
    std::fs::copy(&other_cert, &cert).unwrap();
    std::fs::copy(&other_key, &key).unwrap();
    let pid = serve.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = tls_client(&python, &https, &other_ca);
        if out.contains("completion length") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the renewed certificate was not served after SIGHUP: {out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes a fleet CA and certificates signed by it for `names` (each a list of SANs): returns the
/// CA path and each certificate's (cert, key) paths.
fn fleet_pki(
    dir: &std::path::Path,
    tag: &str,
    names: &[&[&str]],
) -> (String, Vec<(String, String)>) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // A subject of its own: a leaf whose issuer equals its subject looks self-signed to OpenSSL.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("kvroute test CA {tag}"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let path = |file: String| dir.join(file).to_str().unwrap().to_owned();
    let ca_path = path(format!("{tag}-ca.pem"));
    std::fs::write(&ca_path, ca.pem()).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let certs = names
        .iter()
        .enumerate()
        .map(|(i, sans)| {
            let key = KeyPair::generate().unwrap();
            let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
            let cert = CertificateParams::new(sans)
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
            let (c, k) = (
                path(format!("{tag}-{i}.pem")),
                path(format!("{tag}-{i}.key")),
            );
            std::fs::write(&c, cert.pem()).unwrap();
            std::fs::write(&k, key.serialize_pem()).unwrap();
            (c, k)
        })
        .collect();
    (ca_path, certs)
}

/// Mutual TLS between the router and its workers: with `--fleet-ca/--fleet-cert/--fleet-key` on
/// both, the worker registers and serves; a worker without TLS is refused at once, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_workers_talk_mutual_tls_and_a_plain_worker_is_refused() {
    let dir = scratch("security-fleet-tls");
    let (ca, certs) = fleet_pki(
        &dir,
        "fleet",
        &[&["127.0.0.1"], &["127.0.0.1", "localhost"]],
    );
    let (router_cert, router_key) = &certs[0];
    let (worker_cert, worker_key) = &certs[1];
    let serve = Proc::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--fleet-ca",
            &ca,
            "--fleet-cert",
            router_cert,
            "--fleet-key",
            router_key,
        ],
        &dir.join("serve.log"),
    );
    let registry = serve.field("registry").to_owned();
    let base = format!("http://{}", serve.field("http"));
    let _worker = Proc::start(
        &[
            "worker",
            "--mock",
            "--id",
            "1",
            "--router",
            &registry,
            "--speedup",
            "100",
            "--fleet-ca",
            &ca,
            "--fleet-cert",
            worker_cert,
            "--fleet-key",
            worker_key,
        ],
        &dir.join("worker.log"),
    );
    let plain = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["worker", "--mock", "--id", "2", "--router", &registry])
        .output()
        .expect("run kvroute worker");
    assert!(!plain.status.success());
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert!(stderr.contains("over TLS only"), "{stderr}");

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let body = serde_json::json!({"model": "mock", "prompt": "hello", "max_tokens": 2});
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let resp = http
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never served over the fleet's TLS"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
