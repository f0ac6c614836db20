//! Every recorded exchange under `tests/fixtures/`, replayed (see its README).

use crate::support::{check_fixture, fixtures};

async fn check_dir(dir: &str) {
    for fixture in fixtures(dir) {
        check_fixture(&fixture).await;
    }
}

#[tokio::test]
async fn vllm_exchanges() {
    check_dir("vllm").await;
}

#[tokio::test]
async fn sglang_exchanges() {
    check_dir("sglang").await;
}

#[tokio::test]
async fn trtllm_exchanges() {
    check_dir("trtllm").await;
}

#[tokio::test]
async fn openai_exchanges() {
    check_dir("openai").await;
}

#[tokio::test]
async fn llamacpp_documented_exchanges() {
    check_dir("llamacpp-doc").await;
}
