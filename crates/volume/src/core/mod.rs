//! The volume's deterministic state machines (sans-I/O): each owns no socket, clock or thread.
//! One API for the three: `handle(now_us, input)` feeds one input at the driver's monotonic
//! clock, `take_outputs()` returns what it produced, and `check_invariants()` (run after every
//! input in debug builds and after every simulation step) panics naming a broken rule;
//! `check_invariants_deep()` adds the checks too costly for every input of a real service,
//! which the simulation and the model test call. The drivers in [`crate::driver`] and the
//! simulation (`tests/sim_super_collapse.rs`) both run them.

pub mod shard;
pub mod meta;
pub mod membership;
