//! The sans-I/O cores of HEAL: deterministic state machines with no socket, clock or thread.

pub mod cm;
pub mod node;
