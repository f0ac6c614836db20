//! The models the frontend serves: each name with its tokenizer, chat template and
//! end-of-sequence tokens.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::tokenizer::{
    ChatTemplate, HfTokenizer, MOCK_EOS_TOKEN_ID, MockTokenizer, Tokenizer, TokenizerError,
};

/// How to build one served model (the `[[models]]` entries of a config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// The name clients put in `model`.
    pub name: String,
    /// A `tokenizer.json`; `None` uses the built-in [`MockTokenizer`].
    pub tokenizer: Option<PathBuf>,
    /// A Jinja chat template, or a `tokenizer_config.json` holding one; `None` uses the mock
    /// template ([`crate::tokenizer::MOCK_CHAT_TEMPLATE`]).
    pub chat_template: Option<PathBuf>,
    /// LoRA adapters the workers serve on top of this model, by the name clients put in
    /// `model` (as vLLM serves them with `--lora-modules NAME=PATH`). A request naming one is
    /// tokenized as the base model, routed under the adapter's hash salt (an adapter's blocks
    /// are its own) and sent with `model` set to the adapter's name.
    pub lora_adapters: Vec<String>,
    /// Whether the tokenizer encodes with `fastokens` where it can (see
    /// [`HfTokenizer::from_file_with`]); true unless turned off.
    pub fastokens: bool,
}

impl Default for ModelConfig {
    /// The mock model with no name; `fastokens` on.
    fn default() -> Self {
        Self::mock("")
    }
}

impl ModelConfig {
    /// The mock model `name`: built-in tokenizer and template, no files.
    pub fn mock(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tokenizer: None,
            chat_template: None,
            lora_adapters: Vec::new(),
            fastokens: true,
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
    pub template: Arc<ChatTemplate>,
    /// Its end-of-sequence token ids, sent to workers with every request.
    pub eos_token_ids: Vec<u32>,
    /// The LoRA adapter this name serves (`None` for the base model).
    pub lora_name: Option<String>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("lora_name", &self.lora_name)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The mock model `name` (see [`crate::tokenizer`] for its tokenizer).
    pub fn mock(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tokenizer: Arc::new(MockTokenizer),
            template: Arc::new(ChatTemplate::mock()),
            eos_token_ids: vec![MOCK_EOS_TOKEN_ID],
            lora_name: None,
        }
    }

    /// The LoRA adapter `adapter` over this model: the same tokenizer, template and
    /// end-of-sequence tokens under the adapter's name.
    pub fn adapter(&self, adapter: impl Into<String>) -> Self {
        let adapter = adapter.into();
        Self {
            name: adapter.clone(),
            tokenizer: self.tokenizer.clone(),
            template: self.template.clone(),
            eos_token_ids: self.eos_token_ids.clone(),
            lora_name: Some(adapter),
        }
    }

    /// Builds the model `config` describes, reading its files.
    pub fn load(config: &ModelConfig) -> Result<Self, TokenizerError> {
        let Some(path) = &config.tokenizer else {
            let mut model = Self::mock(config.name.clone());
            if let Some(template) = &config.chat_template {
                model.template = Arc::new(ChatTemplate::from_file(template)?);
            }
            return Ok(model);
        };
        let tokenizer = HfTokenizer::from_file_with(path, config.fastokens)?;
        tracing::info!(
            model = %config.name,
            fastokens = tokenizer.encodes_with_fastokens(),
            chunked = tokenizer.tokenizes_in_chunks(),
            "loaded the tokenizer"
        );
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
            template: Arc::new(template),
            eos_token_ids,
            lora_name: None,
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

    /// Loads every model of `configs`, and each one's LoRA adapters under their own names.
    pub fn load(configs: &[ModelConfig]) -> Result<Self, TokenizerError> {
        let mut registry = Self::new();
        for config in configs {
            let model = Model::load(config)?;
            for adapter in &config.lora_adapters {
                registry.insert(model.adapter(adapter.clone()));
            }
            registry.insert(model);
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
