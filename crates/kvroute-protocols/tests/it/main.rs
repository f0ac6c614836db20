//! Integration tests of kvroute-protocols: property round trips of every wire type through JSON
//! and bincode, and decoding of hand-built engine msgpack payloads, and of generated ones against
//! the value-tree decoder the typed walk replaced.

mod roundtrip;
mod strategies;
mod zmq;
mod zmq_differential;
mod zmq_reference;
