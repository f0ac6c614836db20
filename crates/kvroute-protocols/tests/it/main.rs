//! Integration tests of kvroute-protocols: property round trips of every wire type through JSON
//! and bincode, and decoding of hand-built engine msgpack payloads.

mod roundtrip;
mod strategies;
mod zmq;
