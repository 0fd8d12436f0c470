//! The failover experiments of SpecREDS: application recovery latency on plain, super and
//! general-clone volumes (§6.3, [`recovery`]), end-to-end failover latency of REDS, speculative
//! and oracle under real failures (§6.4 Figure 6 and §6.5, [`scenarios`]), and the failover part
//! of `understudy demo` ([`demo`]). [`breakdown`] splits a recovery into its phases from the
//! pool's timing and the application's log; [`shardtrace`] reads the shards' counters per phase.

pub mod breakdown;
pub mod demo;
pub mod recovery;
pub mod scenarios;
pub mod shardtrace;
