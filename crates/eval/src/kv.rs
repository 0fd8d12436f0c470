//! The HEAL experiments (HEAL §IX): recovery after a node failure against the full-copy and
//! reactive-log baselines, YCSB workloads through the project's driver, and a real ZooKeeper
//! ensemble beside a HEAL group. Each runs on a [`testbed::kv::LocalKv`].

pub mod recovery;
pub mod ycsb;
pub mod zookeeper;
