//! Which engine answers at a URL: checked once at start, with requests only the right engine
//! answers correctly, so that a worker pointed at the wrong kind of engine refuses to start
//! instead of failing one request in six. Also learns the engine's context length where the
//! engine states it, so that a prompt that cannot fit is refused before it is sent.
//!
//! | engine | asked | recognised by | context length |
//! | --- | --- | --- | --- |
//! | llama.cpp | `GET /props` | `default_generation_settings` or `total_slots` | `default_generation_settings.n_ctx` (per slot) |
//! | SGLang | `GET /get_model_info` | `model_path` | `GET /v1/models` `max_model_len` |
//! | vLLM | `GET /v1/models` | `owned_by: "vllm"` | `max_model_len` |
//! | TensorRT-LLM, OpenAI | `GET /v1/models` | (not told apart from other OpenAI servers) | `max_model_len` if given |

use serde_json::Value;

use crate::config::EngineKind;

/// What [`crate::HttpEngine::identify`] found at the engine's URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineIdentity {
    /// The engine kind the answers show, when they show one.
    pub found: Option<EngineKind>,
    /// The longest prompt plus output the engine takes, in tokens, when it says.
    pub context_length: Option<u32>,
}

/// Why [`crate::HttpEngine::identify`] refused the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentifyError {
    /// The engine answers like another kind than configured.
    #[error(
        "the engine at {url} was configured as {expected} but answers like {found} ({evidence}); \
         start the worker with --engine {found} (or `engine = \"{found}\"` in the fleet entry), \
         or point it at a {expected} server"
    )]
    WrongKind {
        /// The engine's base URL.
        url: String,
        /// The configured kind.
        expected: EngineKind,
        /// The kind its answers show.
        found: EngineKind,
        /// What gave it away.
        evidence: String,
    },
    /// The engine does not answer what every engine of the configured kind answers.
    #[error(
        "the engine at {url} was configured as {expected} but does not answer like one: {evidence}; \
         check --engine and --engine-url"
    )]
    NotRecognised {
        /// The engine's base URL.
        url: String,
        /// The configured kind.
        expected: EngineKind,
        /// What was asked and answered.
        evidence: String,
    },
}

/// The answers [`crate::HttpEngine::identify`] collected: each probe's JSON body, `None` where
/// the engine answered with an error status, a body that is not JSON, or not at all.
#[derive(Debug, Default)]
pub(crate) struct Answers {
    /// `GET /props` (llama.cpp).
    pub(crate) props: Option<Value>,
    /// `GET /get_model_info` (SGLang).
    pub(crate) model_info: Option<Value>,
    /// `GET /v1/models` (every OpenAI-compatible server).
    pub(crate) models: Option<Value>,
}

/// The paths [`Answers`] are read from, in its field order.
pub(crate) const PROBES: [&str; 3] = ["props", "get_model_info", "v1/models"];

impl Answers {
    fn llamacpp(&self) -> bool {
        self.props.as_ref().is_some_and(|p| {
            p.get("default_generation_settings").is_some() || p.get("total_slots").is_some()
        })
    }

    fn sglang(&self) -> bool {
        self.model_info
            .as_ref()
            .is_some_and(|m| m.get("model_path").is_some())
    }

    /// `owned_by` of the first model listed.
    fn owned_by(&self) -> Option<&str> {
        self.first_model()?.get("owned_by")?.as_str()
    }

    fn first_model(&self) -> Option<&Value> {
        self.models.as_ref()?.get("data")?.as_array()?.first()
    }

    /// The kind the answers show.
    fn found(&self) -> Option<(EngineKind, String)> {
        if self.llamacpp() {
            return Some((
                EngineKind::Llamacpp,
                "GET /props answered with llama.cpp's server properties".to_owned(),
            ));
        }
        if self.sglang() {
            return Some((
                EngineKind::Sglang,
                "GET /get_model_info answered with SGLang's model_path".to_owned(),
            ));
        }
        match self.owned_by() {
            Some("vllm") => Some((
                EngineKind::Vllm,
                "GET /v1/models lists models owned_by \"vllm\"".to_owned(),
            )),
            _ => None,
        }
    }

    fn context_length(&self) -> Option<u32> {
        let n = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        if let Some(props) = &self.props {
            let slot = props
                .get("default_generation_settings")
                .and_then(|s| s.get("n_ctx"))
                .and_then(n);
            if slot.is_some() {
                return slot;
            }
        }
        self.first_model()
            .and_then(|m| m.get("max_model_len"))
            .and_then(n)
    }
}

/// Checks `answers` against the configured `expected` kind of the engine at `url`.
pub(crate) fn check(
    url: &str,
    expected: EngineKind,
    answers: &Answers,
) -> Result<EngineIdentity, IdentifyError> {
    let found = answers.found();
    if let Some((kind, evidence)) = &found
        && *kind != expected
        && expected != EngineKind::Openai
    {
        return Err(IdentifyError::WrongKind {
            url: url.to_owned(),
            expected,
            found: *kind,
            evidence: evidence.clone(),
        });
    }
    // The kinds that always answer their own probe must answer it.
    let missing = match expected {
        EngineKind::Llamacpp if !answers.llamacpp() => {
            Some("GET /props did not answer with llama.cpp's server properties")
        }
        EngineKind::Sglang if !answers.sglang() => {
            Some("GET /get_model_info did not answer with a model_path")
        }
        _ => None,
    };
    if let Some(evidence) = missing {
        return Err(IdentifyError::NotRecognised {
            url: url.to_owned(),
            expected,
            evidence: evidence.to_owned(),
        });
    }
    Ok(EngineIdentity {
        found: found.map(|(kind, _)| kind),
        context_length: answers.context_length(),
    })
}

#[cfg(test)]
mod tests;
