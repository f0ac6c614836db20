//! The request plane specialised to LLM serving: `PreprocessedRequest` in,
//! `Annotated<LLMEngineOutput>` items out.

use kvroute_protocols::{Annotated, LLMEngineOutput, PreprocessedRequest};

use crate::client::{Client, ClientStream};
use crate::engine::Engine;
use crate::push_router::{PushRouter, RoutedStream};

/// One item of an LLM response stream.
pub type LlmResponse = Annotated<LLMEngineOutput>;

/// A connection to an LLM worker.
pub type LlmClient = Client<PreprocessedRequest, LlmResponse>;

/// The responses of one LLM request.
pub type LlmClientStream = ClientStream<LlmResponse>;

/// A push router over LLM workers.
pub type LlmPushRouter = PushRouter<PreprocessedRequest, LlmResponse>;

/// A routed LLM response stream.
pub type LlmRoutedStream = RoutedStream<LlmResponse>;

/// An engine that serves LLM requests; implemented by every [`Engine`] with the LLM types.
pub trait LlmEngine: Engine<Request = PreprocessedRequest, Response = LlmResponse> {}

impl<E: Engine<Request = PreprocessedRequest, Response = LlmResponse>> LlmEngine for E {}
