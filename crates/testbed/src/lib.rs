//! The test bed: local clusters of Understudy's own daemons and the real outside systems the
//! benchmarks compare against, each started as real processes and stopped by PID.
//!
//! * [`volume`]: a local volume cluster (metadata service, shards, NBD server), what
//!   `understudy up` runs, with its [`cluster_file`] (`cluster.json` and the secret), and a
//!   cluster with one volume attached as ext4 ([`volume::AttachedVolume`]);
//! * [`kv`]: a local leaderless KV group (nodes and configuration manager), what `understudy kv up`
//!   runs;
//! * [`nearlog`]: a near-compute log cluster (controller and 3 peers) as processes, supervised
//!   as `understudy nearlog up` runs it, or unsupervised ([`nearlog::LogCluster`]);
//! * [`supervise`]: restarting the daemons of `up`, `kv up` and `nearlog up` when they exit;
//! * [`failover`]: a failover monitor process, its clean-up guard and its control client;
//! * [`failover_hosts`]: the failover application across a [`hostbed`]'s hosts, and its host loss;
//! * [`etcd`]: a real N-member etcd cluster (Debian's etcd-server), the control plane's store;
//! * [`ceph`]: a real single-node Ceph (ceph-mon, one ceph-osd per replica) from Debian's
//!   packages;
//! * [`postgres`], [`mariadb`]: Debian's unmodified PostgreSQL and MariaDB servers run as a
//!   failover instance's application (`understudy failover postgres|mariadb`);
//! * [`sqlite_front`]: the SQLite front, failover's bundled test application;
//! * [`rocksdb`]: the RocksDB load program (C, compiled on demand);
//! * [`qemu`]: qemu-io, the real NBD client of the demo, one-shot and as a session;
//! * [`hosts`]: machines on one box: hosts as network namespaces on a bridge, to kill or cut off;
//! * [`hostbed`]: three such hosts with etcd and every control plane's daemons spread over them;
//! * [`proc`]: the one process helper: start this binary as a daemon, alive, RSS and peak RSS,
//!   signal, group kill, stop and wait.
//!
//! ZooKeeper and Redis are started by their client crates (`zk::Ensemble`,
//! `ycsb::redis::RedisServer`), beside the clients that test them.
//!
//! The daemons are `understudy` subcommands: the clusters re-execute the running executable
//! ([`proc::spawn_self`]), so the caller is the `understudy` binary. Used by `eval` (the paper
//! experiments), the demo and the end-to-end tests alike.

pub mod ceph;
pub mod cluster_file;
mod datadir;
pub mod etcd;
pub mod failover;
pub mod failover_hosts;
pub mod hostbed;
pub mod hosts;
pub mod kv;
pub mod kv_witness;
pub mod mariadb;
pub mod nearlog;
pub mod postgres;
pub mod proc;
pub mod qemu;
pub mod rocksdb;
pub mod sqlite_front;
pub mod supervise;
pub mod volume;
