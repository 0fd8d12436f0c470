//! Losing a whole machine (issue 24 items 7 and 9), on [`testbed::hostbed`]: three hosts
//! (network namespaces), each with an etcd member and one daemon of every kind bound to its own
//! address, and a client host for the test's clients. A host's loss is its link cut and every
//! process in it SIGKILLed: its peers hear nothing (no FIN, no RST), as when a machine dies.
//!
//! Root only (network namespaces): skipped otherwise, with a message.

mod nearlog_common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Lines, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};

use blockdev::BlockDev;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testbed::hostbed::{HostBed, ELECTION_TTL};
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp, META_ELECTION};

const BIN: &str = env!("CARGO_BIN_EXE_understudy");
/// The writer's block.
const BLOCK_BYTES: u64 = 4096;
const VOLUME_BYTES: u64 = 64 << 20;
/// Bound of a takeover after a host's death: the election lease, the store's own election
/// (etcd loses a member too) and a loaded machine's stalls, with room (a takeover is ~1-2 TTLs).
const TAKEOVER_BOUND: Duration = Duration::from_secs(20);
/// Bound of every other wait.
const WAIT: Duration = Duration::from_secs(30);

/// One bed at a time: each is 3 etcd members and 6+ daemons on a loaded 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn bed() -> Option<(std::sync::MutexGuard<'static, ()>, HostBed)> {
    if let Err(e) = testbed::hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Some((g, HostBed::start(BIN.as_ref()).expect("host bed with etcd")))
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// A tokio runtime whose threads are the calling thread's children: called in the client
/// host's namespace, every socket it opens is the client host's.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The host a leader named `prefix-hI` runs on.
fn host_of_name(name: &str) -> usize {
    name.rsplit_once("-h")
        .and_then(|(_, i)| i.parse().ok())
        .unwrap_or_else(|| panic!("leader name {name} names no host"))
}

/// Polls the election `name` until it names a leader other than `not`; returns it and the time.
async fn wait_leader(
    store: &control::Store,
    name: &str,
    not: Option<&str>,
    timeout: Duration,
) -> (String, Duration) {
    let start = Instant::now();
    loop {
        if let Some(l) = store.observe(name).await.ok().flatten() {
            if Some(l.as_str()) != not {
                return (l, start.elapsed());
            }
        }
        assert!(
            start.elapsed() < timeout,
            "no leader of {name} other than {not:?} within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pattern(offset: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES as usize];
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((offset / BLOCK_BYTES) as u8)
            .wrapping_mul(31)
            .wrapping_add(i as u8)
            | 1;
    }
    b
}

/// A client of whichever metadata service leads (a dead host's address costs a dial timeout).
async fn connect(metas: &str, secret: &[u8]) -> Arc<Cluster> {
    let deadline = Instant::now() + WAIT;
    loop {
        match Cluster::connect(metas, secret).await {
            Ok(c) => return c,
            Err(e) => assert!(
                Instant::now() < deadline,
                "no metadata service answered at {metas}: {e:#}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Until the map lists `n` shards up.
async fn wait_shards_up(c: &Cluster, n: usize) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(MetaResp::Map(m)) = c.meta(MetaReq::GetMap).await {
            if m.shards
                .iter()
                .filter(|s| s.state == volume::types::ShardState::Up)
                .count()
                >= n
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{n} shards did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes each block of `vol` once, in order, recording the acknowledged ones with their time.
struct VolWriter {
    acked: Arc<Mutex<BTreeMap<u64, Instant>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl VolWriter {
    fn start(vol: Arc<volume::driver::client::Volume>) -> VolWriter {
        let acked: Arc<Mutex<BTreeMap<u64, Instant>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (acked, stop) = (acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut off = 0;
                while !stop.load(Ordering::Relaxed) && off < VOLUME_BYTES {
                    if vol.write(off, pattern(off)).await.is_ok() {
                        acked.lock().unwrap().insert(off, Instant::now());
                    }
                    off += BLOCK_BYTES;
                }
            })
        };
        VolWriter { acked, stop, task }
    }

    /// Stops the writer; every acknowledged block must read back through `c`.
    async fn finish_and_verify(self, c: &Arc<Cluster>, name: &str) -> BTreeMap<u64, Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let acked = self.acked.lock().unwrap().clone();
        let vol = c.open(name).await.unwrap();
        for &off in acked.keys() {
            assert_eq!(
                vol.read(off, BLOCK_BYTES as u32).await.unwrap(),
                pattern(off),
                "acknowledged block at {off} lost"
            );
        }
        acked
    }
}

/// Item 7: the host of the metadata leader dies (with its shard and its etcd member) under a
/// verifying writer. A service on another host leads, create / super / collapse are served,
/// the writer goes on, and every acknowledged block reads back.
#[test]
fn losing_the_metadata_leaders_host() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let sys = bed.start_volume().unwrap();
        runtime().block_on(async {
            let store = control::Store::open(&bed.store_url(), "volume", &volume::driver::meta::cluster_id_from_secret(bed.secret())).await.unwrap();
            let (leader, _) = wait_leader(&store, META_ELECTION, None, WAIT).await;
            let c = connect(&sys.meta_list(), bed.secret()).await;
            wait_shards_up(&c, 3).await;
            c.meta(MetaReq::Create { name: "vol".into(), size_bytes: VOLUME_BYTES, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
            let w = VolWriter::start(Arc::new(c.open("vol").await.unwrap()));
            tokio::time::sleep(Duration::from_millis(1500)).await;

            let lost = host_of_name(&leader);
            let load_at_kill = load();
            let killed = Instant::now();
            bed.kill_host(lost).unwrap();
            let (new_leader, takeover) = wait_leader(&store, META_ELECTION, Some(&leader), TAKEOVER_BOUND).await;
            assert_ne!(host_of_name(&new_leader), lost);
            // The next decision served: a create through the new leader (the client dials the list).
            let first_create = loop {
                let create = MetaReq::Create { name: "side".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES };
                // Bounded: a request must not wait forever on the dead leader's connection.
                match tokio::time::timeout(WAIT, c.meta(create)).await.expect("a metadata request hung on the dead leader's connection") {
                    Ok(MetaResp::Volume(_)) => break killed.elapsed(),
                    r => {
                        assert!(killed.elapsed() < WAIT, "no create served after the takeover: {r:?}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            let side = c.open("side").await.unwrap();
            side.write(0, pattern(0)).await.unwrap();
            let r = c.meta(MetaReq::Super { parent: "side".into(), child: "side-c".into() }).await.unwrap();
            assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
            let r = c.collapse("side-c", WAIT).await.unwrap();
            assert!(matches!(r, MetaResp::Collapsed { .. }), "{r:?}");
            // The writer goes on after the takeover, then everything acknowledged reads back
            // through a fresh client.
            tokio::time::sleep(Duration::from_millis(2000)).await;
            let c2 = connect(&sys.meta_list(), bed.secret()).await;
            let acked = w.finish_and_verify(&c2, "vol").await;
            let after = acked.values().filter(|t| **t > killed + takeover).count();
            eprintln!(
                "meta leader's host lost: {new_leader} leads {} ms after (election TTL {} ms, ratio {:.2}); first create {} ms after; \
                 {} blocks acknowledged ({after} after the takeover), all read back; load {load_at_kill}",
                takeover.as_millis(),
                ELECTION_TTL.as_millis(),
                takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
                first_create.as_millis(),
                acked.len(),
            );
            assert!(after > 10, "too few writes acknowledged after the takeover: {after}");
        });
    })
    .unwrap();
}

/// Operations recorded for the linearizability checker, and the clock they are timed on.
struct KvLoad {
    history: Arc<Mutex<Vec<kv::checker::Op>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    t0: Instant,
}

impl KvLoad {
    /// 4 clients, puts and gets on 16 keys, every operation recorded.
    fn start(c: &kv::leaderless::driver::KvCluster) -> KvLoad {
        use kv::checker::{Op, OpKind};
        let t0 = Instant::now();
        let us = move || t0.elapsed().as_micros() as u64;
        let history: Arc<Mutex<Vec<Op>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for client in 0..4u64 {
            let (c, history, stop) = (c.clone(), history.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = format!("k{}", (n * 7 + client * 3) % 16).into_bytes();
                    let call_us = us();
                    let op = if n.is_multiple_of(2) {
                        let val = format!("c{client}-{n}").into_bytes();
                        let r = c.put(&key, &val).await;
                        Op {
                            client,
                            key,
                            call_us,
                            ret_us: r.is_ok().then(us),
                            kind: OpKind::Put(val),
                        }
                    } else {
                        match c.get(&key).await {
                            Ok(v) => Op {
                                client,
                                key,
                                call_us,
                                ret_us: Some(us()),
                                kind: OpKind::Get(v),
                            },
                            // A read with no answer constrains nothing.
                            Err(_) => continue,
                        }
                    };
                    history.lock().unwrap().push(op);
                }
            }));
        }
        KvLoad {
            history,
            stop,
            tasks,
            t0,
        }
    }

    fn us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Stops the clients and checks the history (panics with the violation).
    async fn finish(self) -> Vec<kv::checker::Op> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let history = self.history.lock().unwrap().clone();
        if let Err(v) = kv::checker::check(&history) {
            panic!("{v}");
        }
        history
    }
}

/// Operations of each kind answered that were called after `after_us`.
fn served_after(history: &[kv::checker::Op], after_us: u64, put: bool) -> usize {
    history
        .iter()
        .filter(|o| {
            o.call_us > after_us
                && o.ret_us.is_some()
                && matches!(o.kind, kv::checker::OpKind::Put(_)) == put
        })
        .count()
}

/// Waits (at most [`WAIT`]) until the clients have had more than 20 puts and 20 gets answered
/// that were called after `after_us`; returns how long that took.
async fn wait_served_after(l: &KvLoad, after_us: u64) -> Duration {
    let start = Instant::now();
    loop {
        let (puts, gets) = {
            let h = l.history.lock().unwrap();
            (
                served_after(&h, after_us, true),
                served_after(&h, after_us, false),
            )
        };
        if puts > 20 && gets > 20 {
            return start.elapsed();
        }
        if start.elapsed() > WAIT {
            // The check after `finish` reports the counts.
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A kv group on the bed, serving: its store handle, a client of every node, the leading CM.
async fn kv_group(bed: &HostBed) -> (control::Store, kv::leaderless::driver::KvCluster, String) {
    use kv::leaderless::driver::{cluster_id_from_secret, KvCluster, CM_ELECTION};
    let sys = bed.start_kv().unwrap();
    let store = control::Store::open(
        &bed.store_url(),
        "kv",
        &cluster_id_from_secret(bed.secret()),
    )
    .await
    .unwrap();
    let (leader, _) = wait_leader(&store, CM_ELECTION, None, WAIT).await;
    let c = KvCluster::new(sys.nodes.clone(), bed.secret().to_vec());
    let deadline = Instant::now() + WAIT;
    while c.put(b"warmup", b"1").await.is_err() || c.get(b"warmup").await.is_err() {
        assert!(Instant::now() < deadline, "the kv group never served");
    }
    (store, c, leader)
}

/// Until node `id` is marked removed in the store (by the leading CM's guarded write); returns
/// the configuration epoch then.
async fn wait_node_removed(store: &control::Store, id: usize, since: Instant) -> (u64, Duration) {
    loop {
        let n = store
            .get(&store.key("kv", "node", &format!("{id:05}")))
            .await
            .ok()
            .flatten();
        if n.is_some_and(|n| n.value == b"removed") {
            let epoch = store
                .get(&store.key("kv", "cm", "epoch"))
                .await
                .unwrap()
                .unwrap();
            return (
                String::from_utf8_lossy(&epoch.value).parse().unwrap(),
                since.elapsed(),
            );
        }
        assert!(since.elapsed() < WAIT, "node {id} was never removed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Item 7: the host of the kv CM leader dies (with its kv node and etcd member) under 4
/// clients. A CM on another host leads, removes the dead host's node (configuration epoch up,
/// written under its election), the group serves on, and the history is linearizable.
#[test]
fn losing_the_kv_cm_leaders_host() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        runtime().block_on(async {
            use kv::leaderless::driver::CM_ELECTION;
            let (store, c, leader) = kv_group(&bed).await;
            let l = KvLoad::start(&c);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let lost = host_of_name(&leader);
            let load_at_kill = load();
            let killed = Instant::now();
            bed.kill_host(lost).unwrap();
            let (new_leader, takeover) = wait_leader(&store, CM_ELECTION, Some(&leader), TAKEOVER_BOUND).await;
            assert_ne!(host_of_name(&new_leader), lost);
            let (epoch, removed_after) = wait_node_removed(&store, lost, killed).await;
            assert!(epoch >= 2, "the removal moved the configuration epoch: {epoch}");
            let reconfigured_us = l.us();
            let serving_again = wait_served_after(&l, reconfigured_us).await;
            let history = l.finish().await;
            let (puts, gets) = (served_after(&history, reconfigured_us, true), served_after(&history, reconfigured_us, false));
            eprintln!(
                "kv CM leader's host lost: {new_leader} leads {} ms after (election TTL {} ms, ratio {:.2}); node {lost} removed {} ms after \
                 (epoch {epoch}); 20 puts and gets served {} ms after the removal; {} ops linearizable; load {load_at_kill}",
                takeover.as_millis(),
                ELECTION_TTL.as_millis(),
                takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
                removed_after.as_millis(),
                serving_again.as_millis(),
                history.len(),
            );
            assert!(puts > 20 && gets > 20, "too few operations served after the removal: {puts} puts, {gets} gets");
        });
    })
    .unwrap();
}

/// Item 9: the kv CM leader's host is cut off (not killed) under 4 clients. A CM on the
/// majority side leads and removes the cut-off node; the old leader, unable to renew its lease
/// or write to etcd from the minority, stops acting; healed, it stands by (the election stays
/// with the new leader) and the history is linearizable.
#[test]
fn a_partitioned_kv_cm_leader_steps_down_and_never_commits() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        runtime().block_on(async {
            use kv::leaderless::driver::CM_ELECTION;
            let (store, c, leader) = kv_group(&bed).await;
            let l = KvLoad::start(&c);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let cut = host_of_name(&leader);
            let load_at_cut = load();
            let cut_at = Instant::now();
            bed.partition(cut).unwrap();
            let (new_leader, takeover) = wait_leader(&store, CM_ELECTION, Some(&leader), TAKEOVER_BOUND).await;
            assert_ne!(host_of_name(&new_leader), cut);
            let (epoch, removed_after) = wait_node_removed(&store, cut, cut_at).await;
            // The old leader noticed on its own, still cut off: it stops acting.
            let log = bed.log(&leader);
            let deadline = Instant::now() + WAIT;
            while !std::fs::read_to_string(&log).unwrap_or_default().contains("no longer leading") {
                assert!(Instant::now() < deadline, "the cut-off leader did not step down: {}", bed.tail(&leader, 10));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let stepped_down = cut_at.elapsed();
            let epoch_key = store.get(&store.key("kv", "cm", "epoch")).await.unwrap().unwrap();
            bed.heal(cut).unwrap();
            // Healed, it stands by: it does not lead again (the majority side's CMs may hand
            // leadership on among themselves: one that cannot confirm a write steps down too).
            let until = Instant::now() + 2 * ELECTION_TTL;
            while Instant::now() < until {
                assert_ne!(store.observe(CM_ELECTION).await.unwrap().as_deref(), Some(leader.as_str()), "the healed old leader must stand by");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(bed.exit_status(&leader).is_none(), "the old leader exited instead of standing by: {}", bed.tail(&leader, 10));
            let old_log = std::fs::read_to_string(&log).unwrap();
            let after_step_down = &old_log[old_log.rfind("no longer leading").unwrap()..];
            assert!(!after_step_down.contains("cm: leading"), "the old leader led again: {old_log}");
            let healed_us = l.us();
            let serving_again = wait_served_after(&l, healed_us).await;
            let history = l.finish().await;
            let (puts, gets) = (served_after(&history, healed_us, true), served_after(&history, healed_us, false));
            let epoch_now = store.get(&store.key("kv", "cm", "epoch")).await.unwrap().unwrap();
            eprintln!(
                "kv CM leader's host cut off: {new_leader} leads {} ms after (election TTL {} ms, ratio {:.2}); node {cut} removed {} ms after \
                 (epoch {epoch}); the old leader had stepped down (log) {} ms after the cut; epoch key revision {} -> {} after the heal; \
                 20 puts and gets served {} ms after the heal; {} ops linearizable; load {load_at_cut}",
                takeover.as_millis(),
                ELECTION_TTL.as_millis(),
                takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
                removed_after.as_millis(),
                stepped_down.as_millis(),
                epoch_key.mod_revision,
                epoch_now.mod_revision,
                serving_again.as_millis(),
                history.len(),
            );
            assert!(puts > 20 && gets > 20, "too few operations served after the heal: {puts} puts, {gets} gets");
        });
    })
    .unwrap();
}

const CHUNK: usize = 16 << 10;

/// For each line `N` on stdin: appends N chunks of CHUNK bytes (byte = chunk index mod 251),
/// each with os.write + fsync, then prints the file size (every byte of it acknowledged).
const NL_WRITER: &str = r#"
import os, sys
path, chunk = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
i = 0
for line in sys.stdin:
    for _ in range(int(line)):
        n = os.write(fd, bytes([i % 251]) * chunk)
        assert n == chunk, "short write %d" % n
        os.fsync(fd)
        i += 1
    print(os.fstat(fd).st_size, flush=True)
"#;

fn nl_expected(bytes: usize) -> Vec<u8> {
    (0..bytes / CHUNK)
        .flat_map(|i| std::iter::repeat_n((i % 251) as u8, CHUNK))
        .collect()
}

/// A python3 writer under the shim, started from the calling thread (so on its host).
struct NlWriter {
    log: PathBuf,
    err: PathBuf,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    child: nearlog_common::Kill,
}

impl NlWriter {
    fn start(log: &Path, env: &dyn Fn(&mut Command)) -> NlWriter {
        let mut cmd = Command::new("python3");
        cmd.arg("-c")
            .arg(NL_WRITER)
            .arg(log)
            .arg(CHUNK.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let err = log.with_extension("err");
        cmd.stderr(std::fs::File::create(&err).unwrap());
        env(&mut cmd);
        let mut child = nearlog_common::Kill(cmd.spawn().unwrap());
        let stdin = child.0.stdin.take().unwrap();
        let lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        NlWriter {
            log: log.to_path_buf(),
            err,
            stdin: Some(stdin),
            lines,
            child,
        }
    }

    /// Appends `n` chunks; returns the acknowledged size.
    fn step(&mut self, n: u32) -> usize {
        // Paced: the peers lend 64 MiB, and a takeover of up to 20 s must not fill it.
        std::thread::sleep(Duration::from_millis(20));
        writeln!(self.stdin.as_mut().unwrap(), "{n}").unwrap();
        match self.lines.next() {
            Some(Ok(l)) => l.trim().parse().unwrap(),
            _ => panic!(
                "the writer of {} died: {}",
                self.log.display(),
                std::fs::read_to_string(&self.err).unwrap_or_default()
            ),
        }
    }

    /// Ends the writer and recovers its file through the shim: exactly the `acked` bytes.
    fn check_recovers(mut self, env: &dyn Fn(&mut Command), acked: usize) {
        drop(self.stdin.take());
        let _ = self.child.0.wait();
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        let t = Instant::now();
        let got = nearlog_common::recover_through_shim(&self.log, env);
        eprintln!(
            "{} read back through the shim in {} ms",
            self.log.display(),
            t.elapsed().as_millis()
        );
        assert_eq!(
            got.len(),
            acked,
            "recovered length of {}; writer said: {err}",
            self.log.display()
        );
        assert!(
            got == nl_expected(acked),
            "recovered content of {} differs from the acknowledged writes",
            self.log.display()
        );
    }
}

/// The controller that answers (only the leader listens), and its state.
fn nl_leader(
    sys: &testbed::hostbed::NearlogSys,
    secret: &[u8],
) -> Option<(String, nearlog::proto::ControllerState)> {
    use nearlog::proto::{CtlReply, CtlRequest};
    sys.controllers.iter().find_map(|addr| {
        let mut s =
            nearlog::driver::blocking::connect(addr, secret, Duration::from_secs(1)).ok()?;
        match nearlog::driver::blocking::call::<_, CtlReply>(
            &mut s,
            &CtlRequest::Status,
            nearlog::proto::MAX_FRAME_BYTES,
        )
        .ok()?
        {
            CtlReply::Status(st) => Some((addr.clone(), st)),
            _ => None,
        }
    })
}

/// A nearlog cluster on the bed with its 3 peers live at the leader, and the shim's
/// environment for a writer on the client host.
fn nearlog_cluster(bed: &HostBed) -> (testbed::hostbed::NearlogSys, impl Fn(&mut Command)) {
    let sys = bed.start_nearlog().unwrap();
    let t = Instant::now();
    while nl_leader(&sys, bed.secret())
        .is_none_or(|(_, st)| st.peers.values().filter(|p| p.live).count() < 3)
    {
        assert!(
            t.elapsed() < WAIT,
            "no controller with 3 live peers within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let shim = nearlog_common::shim_path();
    let cluster = sys.cluster_file.clone();
    let env = move |c: &mut Command| {
        c.env("LD_PRELOAD", &shim)
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    };
    (sys, env)
}

/// Item 7: the host of the nearlog controller leader dies (with a log peer of the writer's
/// file and an etcd member) while a shim writer appends and fsyncs. A controller on another host
/// leads; the writer goes on on the file's other peers; everything acknowledged is recovered.
#[test]
fn losing_the_nearlog_controller_leaders_host() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let (sys, env) = nearlog_cluster(&bed);
        let app = bed.dir().join("app");
        std::fs::create_dir_all(&app).unwrap();
        let mut w = NlWriter::start(&app.join("w.log"), &env);
        w.step(64);
        let (leader, _) = nl_leader(&sys, bed.secret()).unwrap();
        let lost = bed.host_of(&leader).unwrap();
        let load_at_kill = load();
        let killed = Instant::now();
        bed.kill_host(lost).unwrap();
        let mut during = 0;
        let (new_leader, took) = loop {
            w.step(1);
            during += 1;
            if let Some((l, _)) = nl_leader(&sys, bed.secret()) {
                break (l, killed.elapsed());
            }
            assert!(killed.elapsed() < TAKEOVER_BOUND, "no controller took over within {TAKEOVER_BOUND:?}");
        };
        assert_ne!(bed.host_of(&new_leader), Some(lost));
        // The writer goes on for two peer leases past the takeover (the new leader finds the
        // lost peer lost), then everything acknowledged is recovered through the shim.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(2 * testbed::hostbed::NEARLOG_PEER_LEASE_MS) {
            w.step(1);
        }
        let acked = w.step(16);
        eprintln!(
            "nearlog controller leader's host lost: {new_leader} serves {} ms after (election TTL {} ms, ratio {:.2}); \
             {during} fsyncs acknowledged meanwhile; {acked} bytes acknowledged in all; load {load_at_kill}",
            took.as_millis(),
            ELECTION_TTL.as_millis(),
            took.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
        );
        w.check_recovers(&env, acked);
    })
    .unwrap();
}

/// Item 7: a log peer's host dies (not the controller leader's): the leader finds the peer lost
/// within its lease, the writer goes on, and everything acknowledged is recovered.
#[test]
fn losing_a_log_peers_host() {
    let t0 = Instant::now();
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let (sys, env) = nearlog_cluster(&bed);
        eprintln!("bed and nearlog cluster up in {} ms", t0.elapsed().as_millis());
        let app = bed.dir().join("app");
        std::fs::create_dir_all(&app).unwrap();
        let mut w = NlWriter::start(&app.join("w.log"), &env);
        w.step(64);
        let (leader, _) = nl_leader(&sys, bed.secret()).unwrap();
        let leader_host = bed.host_of(&leader).unwrap();
        let lost = (0..testbed::hostbed::SERVER_HOSTS).find(|h| *h != leader_host).unwrap();
        let load_at_kill = load();
        let killed = Instant::now();
        bed.kill_host(lost).unwrap();
        let lost_addr = &sys.peers[lost];
        let took = loop {
            w.step(1);
            // The leader's host lives, but its etcd lease may not: losing a member (perhaps
            // etcd's own leader) can outlast a 2 s TTL, and a standby then leads. Whoever
            // leads must find the peer lost; a moment with no leader is waited out.
            if let Some((_, st)) = nl_leader(&sys, bed.secret()) {
                if st.peers.values().any(|p| &p.addr == lost_addr && !p.live) {
                    break killed.elapsed();
                }
            }
            assert!(killed.elapsed() < WAIT, "the leader did not find the lost peer lost within {WAIT:?}");
        };
        let acked = w.step(32);
        eprintln!(
            "log peer's host lost: the controller found it lost {} ms after (peer lease {} ms); {acked} bytes acknowledged; load {load_at_kill}",
            took.as_millis(),
            testbed::hostbed::NEARLOG_PEER_LEASE_MS,
        );
        w.check_recovers(&env, acked);
    })
    .unwrap();
}

/// Item 7: a shard's host dies (with a standby metadata service and an etcd member; not the
/// leader's host) under a verifying writer: the leader marks the shard down, the writer goes on
/// on the other replicas, and every acknowledged block reads back.
#[test]
fn losing_a_shards_host() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let sys = bed.start_volume().unwrap();
        runtime().block_on(async {
            let store = control::Store::open(&bed.store_url(), "volume", &volume::driver::meta::cluster_id_from_secret(bed.secret())).await.unwrap();
            let (leader, _) = wait_leader(&store, META_ELECTION, None, WAIT).await;
            let c = connect(&sys.meta_list(), bed.secret()).await;
            wait_shards_up(&c, 3).await;
            c.meta(MetaReq::Create { name: "vol".into(), size_bytes: VOLUME_BYTES, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
            let w = VolWriter::start(Arc::new(c.open("vol").await.unwrap()));
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let lost = (0..testbed::hostbed::SERVER_HOSTS).find(|h| *h != host_of_name(&leader)).unwrap();
            let load_at_kill = load();
            let killed = Instant::now();
            bed.kill_host(lost).unwrap();
            // The leader marks the shard down (its pings go unanswered).
            let down_after = loop {
                let r = tokio::time::timeout(WAIT, c.meta(MetaReq::GetMap)).await.expect("the leader answers");
                if let Ok(MetaResp::Map(m)) = r {
                    if m.shards.iter().any(|s| s.id == lost as u32 && s.state == volume::types::ShardState::Down) {
                        break killed.elapsed();
                    }
                }
                assert!(killed.elapsed() < WAIT, "shard {lost} was never marked down");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            tokio::time::sleep(Duration::from_millis(3000)).await;
            let acked = w.finish_and_verify(&c, "vol").await;
            let after = acked.values().filter(|t| **t > killed + down_after).count();
            eprintln!(
                "shard's host lost: shard {lost} down {} ms after (down after {} ms); {} blocks acknowledged ({after} after), all read back; load {load_at_kill}",
                down_after.as_millis(),
                testbed::hostbed::SHARD_DOWN_AFTER_MS,
                acked.len(),
            );
            assert!(after > 10, "too few writes acknowledged after the shard was marked down: {after}");
        });
    })
    .unwrap();
}
