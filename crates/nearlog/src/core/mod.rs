//! The nearlog's deterministic state machines (sans-I/O): each owns no socket, clock or thread
//! and checks its invariants after every input in debug builds. The drivers in
//! [`crate::driver`], the LD_PRELOAD shim and the simulations (`tests/sim_*.rs`) all run them.

pub mod controller;
pub mod file_client;
pub mod peer;
