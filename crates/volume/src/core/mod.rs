//! The volume's deterministic state machines (sans-I/O): each takes inputs and returns outputs,
//! owns no socket, clock or thread, and checks its invariants after every input. The drivers in
//! [`crate::driver`] and the simulation (`tests/sim_super_collapse.rs`) both run them.

pub mod shard;
pub mod meta;
pub mod membership;
