//! Integration tests of the kvroute runtime over loopback: the request plane under concurrency,
//! cancellation, worker loss and hostile input; gap recovery; discovery; the push router; the
//! ZMQ KV event listener, against hand-built frames and against the real vLLM and SGLang publisher
//! code.

mod cancel;
mod discovery;
mod failure;
mod fleet_secret;
mod fleet_tls;
mod frames;
mod kv;
mod kv_publishers;
mod load_reports;
mod local;
mod remote;
mod router;
mod streams;
mod support;
mod vllm_publisher;
mod zmq;
