//! Leaderless replicated key-value store with HEAL online incremental recovery.
//!
//! Implements the HEAL paper ("HEAL: Online Incremental Recovery for Leaderless Distributed
//! Systems Across Persistency Models"): the Hermes-style INV / ACK / VAL write
//! protocol with per-key Lamport timestamps ⟨version, node_id⟩ (§II-B), the five persistency
//! models of Table I under linearizable consistency (§II-A, §V-E), replay on timeouts and after
//! reconfiguration (§V-F, Table III), a configuration manager with heartbeats, epochs and the EFN
//! period (§IV, §V-A), and HEAL recovery: Missed_updates, Partially_persisted, Buddy,
//! Recov_start / CatchUp / Recov_end, ShadowReplica (§V-B/C, Fig. 4, Table II). The catch-up is
//! pulled one bounded chunk at a time, so the two baselines of §IX run in the same core and
//! harness: a full copy of the store (Hermes), and the reactive log of §II-C (ZooKeeper: a peer
//! reads its durable log from the recovering node's last configuration, redundant updates
//! included). The log is bounded by compaction.
//!
//! Layout: [`pmlog`] (the emulated persistent-memory log with a per-entry GDP/commit flag, its
//! file implementation and the record format both KVs share), [`leaderless`] (HEAL:
//! [`leaderless::proto`] the messages, [`leaderless::core`] the sans-I/O cores —
//! [`leaderless::core::node::NodeCore`] the replica, [`leaderless::core::cm::CmCore`] the
//! configuration manager, each `handle(now_us, input)` / `take_outputs()` /
//! `check_invariants()` — and [`leaderless::driver`] the tokio drivers: node server, CM server,
//! async clients, structured events), and [`checker`] (a Porcupine/Knossos-style
//! linearizability checker for per-key registers). [`witness`] is CANDStore, being built beside
//! `leaderless`: its sans-I/O core (a Raft variant with witnesses, live recovery by pulls), the
//! backup's storage tiers and a simulation; no driver or command runs it yet.

pub mod checker;
pub mod leaderless;
pub mod pmlog;
pub mod witness;

pub use leaderless::proto::{Model, NodeId, Ts};
