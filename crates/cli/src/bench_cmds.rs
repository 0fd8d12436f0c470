//! `understudy bench <area> <scenario>`: benchmarks as commands, per `BENCH.md`.
//!
//! Each one brings up a throw-away local cluster (real processes on loopback), measures, and
//! prints one JSON line on stdout (progress on stderr; plots, CSV in `--out`).

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Benchmarks of the volume layer (SpecREDS §6.2).
    #[command(subcommand)]
    Volume(VolumeBench),
    /// YCSB workloads through the project's own driver (crate ycsb).
    #[command(subcommand)]
    Ycsb(eval::ycsb::YcsbBench),
    /// Benchmarks of speculative failover (SpecREDS §6.3–6.5).
    #[command(subcommand)]
    Failover(crate::failover::FailoverBench),
    /// Benchmarks of the leaderless KV store (HEAL §IX).
    #[command(subcommand)]
    Kv(crate::kv::KvBench),
    /// Benchmarks of the near-compute log (SplitFT).
    #[command(subcommand)]
    Nearlog(crate::nearlog::NearlogBench),
    /// Benchmarks of the control plane on etcd (issue 24).
    #[command(subcommand)]
    Control(ControlBench),
}

#[derive(Subcommand, Debug)]
pub enum ControlBench {
    /// Takeover when a leader's machine dies, against the lease TTL and the embedded restart.
    ///
    /// For the volume metadata service, the kv CM and the nearlog controller, each on a fresh bed
    /// of network-namespace hosts (three servers, each with an etcd member, one instance of the
    /// leader and a data-path daemon; one client host): the leader's host is lost (link cut,
    /// every process SIGKILLed) and the time to the next decision served by a standby is
    /// measured (a volume create; the dead kv node's removal; a log file's open), median and
    /// spread over the repetitions, as a ratio to the election lease TTL. Also the longest gap
    /// between acknowledged writes of a writer on an open volume when the metadata leader's
    /// host (with a shard) dies, against a shard's process alone; the embedded store's restart
    /// under `understudy volume up`; super and collapse latency on etcd against the embedded
    /// store, interleaved. The failover monitor (on `testbed::hostbed`, the `failover_hosts`
    /// test's scenario): the primary's host lost under a SQLite load through an endpoint on
    /// another host, until the promoted primary serves; the leading monitor's host lost with
    /// it, until the standby promotes. A log peer's host lost: until its files are
    /// re-replicated on a spare peer, against 2× the peer lease plus their bytes at the disk
    /// speed the run measures. Needs root (network namespaces) and Debian's etcd-server.
    Failover(eval::control::FailoverArgs),
}

#[derive(Subcommand, Debug)]
pub enum VolumeBench {
    /// Copy-on-write cost of super against a plain volume and an rbd-style general clone.
    ///
    /// (a) single COW write latency for 4–64 KiB writes; (b) 4 KiB COW latency at 1–32 writes in
    /// flight — every measured clone write hits an object not yet copied; (d) the parent's 4 KiB
    /// IOPS at depth 32 with `super` invoked every second, against none. Also the plain volume's
    /// 4 KiB IOPS through fio's NBD engine next to fio on a local file with --fdatasync=1, and
    /// the peak resident memory of shards and client. Variants are interleaved batch by batch.
    Cow(eval::volume::CommonArgs),
    /// Replay of a real application's recovery on plain, super and general clone (Figure 4c/4d).
    ///
    /// Loads SQLite (WAL mode, synchronous=FULL) on an ext4 volume attached through FUSE and a
    /// loop device, kills it with SIGKILL mid-load, and records the block trace of its recovery
    /// on a re-attached volume (integrity and every acknowledged row are checked); then replays
    /// the trace on the plain volume, a fresh super child and a fresh general clone, interleaved,
    /// and reports read and write latency percentiles. Needs root, /dev/fuse, sqlite3, python3.
    RecoveryTrace(eval::volume::CommonArgs),
    /// Understudy beside a real single-node Ceph 16.2 (rbd and rbd clone), measured with fio.
    ///
    /// Starts ceph-mon and one ceph-osd per replica (each BlueStore on a file of its own; pool
    /// size 3 and min_size 2 by default, Ceph's defaults, beside Understudy's 3 replicas) in a
    /// temporary directory, then measures 4 KiB random-write latency at depth 1 and IOPS at depth 32 on an rbd image
    /// (64 KiB and 4 MiB objects), an rbd clone (every write a copy-up), Understudy's plain
    /// volume and its super child — fio's rbd engine for Ceph, its NBD engine for Understudy,
    /// variants interleaved. Needs Debian's ceph-mon, ceph-osd and ceph-common (not installed
    /// by scripts/install-deps): apt-get install --no-install-recommends ceph-mon ceph-osd ceph-common.
    Ceph(eval::volume::ceph::CephArgs),
}

pub fn run(cmd: BenchCmd, verbose: u8) -> anyhow::Result<()> {
    // Each experiment returns its report; the CLI prints it (JSON as stdout's last line).
    let report = match cmd {
        BenchCmd::Volume(VolumeBench::Cow(a)) => eval::volume::cow_main(a, verbose)?,
        BenchCmd::Volume(VolumeBench::RecoveryTrace(a)) => eval::volume::recovery_trace_main(a, verbose)?,
        BenchCmd::Volume(VolumeBench::Ceph(a)) => eval::volume::ceph::run(a, verbose)?,
        BenchCmd::Failover(b) => crate::failover::bench(b, verbose)?,
        BenchCmd::Nearlog(b) => crate::nearlog::bench(b, verbose)?,
        BenchCmd::Control(ControlBench::Failover(a)) => eval::control::failover_main(a)?,
        // The YCSB experiments print their reports themselves, before their check of the
        // reads can fail (kv's other experiments return theirs, printed in `kv::bench`).
        BenchCmd::Ycsb(cmd) => return eval::ycsb::run(cmd),
        BenchCmd::Kv(b) => return crate::kv::bench(b, verbose),
    };
    report.print();
    Ok(())
}
