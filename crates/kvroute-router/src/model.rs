//! The models the frontend serves: each name with its tokenizer, chat template and
//! end-of-sequence tokens.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::tokenizer::{
    ChatTemplate, HfTokenizer, MOCK_EOS_TOKEN_ID, MockTokenizer, Tokenizer, TokenizerError,
};

/// How to build one served model (the `[[models]]` entries of a config file).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelConfig {
    /// The name clients put in `model`.
    pub name: String,
    /// A `tokenizer.json`; `None` uses the built-in [`MockTokenizer`].
    pub tokenizer: Option<PathBuf>,
    /// A Jinja chat template, or a `tokenizer_config.json` holding one; `None` uses the mock
    /// template ([`crate::tokenizer::MOCK_CHAT_TEMPLATE`]).
    pub chat_template: Option<PathBuf>,
}

impl ModelConfig {
    /// The mock model `name`: built-in tokenizer and template, no files.
    pub fn mock(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tokenizer: None,
            chat_template: None,
        }
    }
}

/// One served model.
pub struct Model {
    /// Its name.
    pub name: String,
    /// Its tokenizer.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// Its chat template.
    pub template: ChatTemplate,
    /// Its end-of-sequence token ids, sent to workers with every request.
    pub eos_token_ids: Vec<u32>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The mock model `name` (see [`crate::tokenizer`] for its tokenizer).
    pub fn mock(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tokenizer: Arc::new(MockTokenizer),
            template: ChatTemplate::mock(),
            eos_token_ids: vec![MOCK_EOS_TOKEN_ID],
        }
    }

    /// Builds the model `config` describes, reading its files.
    pub fn load(config: &ModelConfig) -> Result<Self, TokenizerError> {
        let Some(path) = &config.tokenizer else {
            let mut model = Self::mock(config.name.clone());
            if let Some(template) = &config.chat_template {
                model.template = ChatTemplate::from_file(template)?;
            }
            return Ok(model);
        };
        let tokenizer = HfTokenizer::from_file(path)?;
        let template = match &config.chat_template {
            Some(t) => ChatTemplate::from_file(t)?,
            None => ChatTemplate::mock(),
        };
        let eos_token_ids = ["</s>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>"]
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        Ok(Self {
            name: config.name.clone(),
            tokenizer: Arc::new(tokenizer),
            template,
            eos_token_ids,
        })
    }
}

/// The served models by name.
#[derive(Debug, Default, Clone)]
pub struct ModelRegistry {
    models: BTreeMap<String, Arc<Model>>,
}

impl ModelRegistry {
    /// No models.
    pub fn new() -> Self {
        Self::default()
    }

    /// One mock model named `name`.
    pub fn mock(name: impl Into<String>) -> Self {
        let mut registry = Self::new();
        registry.insert(Model::mock(name));
        registry
    }

    /// Loads every model of `configs`.
    pub fn load(configs: &[ModelConfig]) -> Result<Self, TokenizerError> {
        let mut registry = Self::new();
        for config in configs {
            registry.insert(Model::load(config)?);
        }
        Ok(registry)
    }

    /// Adds (or replaces) a model.
    pub fn insert(&mut self, model: Model) {
        self.models.insert(model.name.clone(), Arc::new(model));
    }

    /// The model named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Model>> {
        self.models.get(name)
    }

    /// The model names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }
}
