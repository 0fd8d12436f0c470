//! The volume experiments of SpecREDS §6.2: the disk-level copy-on-write latency and IOPS
//! (Figure 4a, 4b) and the replay of a real database recovery (Figure 4c, 4d).

pub mod cow;
pub mod recovery_trace;
