//! Shards keep a liveness lease in a real 3-member etcd (`volume shard --store`, issue 24 §3):
//! one metadata service on the same etcd, three leased shards (two copies of every object), a
//! verifying writer (every acknowledged block reads back at the end).
//!
//! * A shard stopped (SIGSTOP: its links stay open, so only its lease can tell) is marked down
//!   once its lease expires, with the pings' timeout set far beyond the test; writes go on.
//! * A shard cut off from etcd alone (its etcd traffic goes through a relay the test cuts, as a
//!   partition would: connections accepted, never answered) fences itself within the TTL,
//!   *before* the metadata service marks it down (so no two primaries take writes for one slot);
//!   writes go on elsewhere; healed, it registers under a new lease, is re-admitted, and lifts
//!   its fence.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blockdev::BlockDev;
use volume::driver::client::Cluster;
use volume::driver::meta::{cluster_id_from_secret, MetaReq, MetaResp};
use volume::types::ShardState;

/// The shards' lease TTL (etcd's are whole seconds).
const LEASE_TTL: Duration = Duration::from_secs(2);
/// The metadata services' election lease.
const ELECTION_TTL: Duration = Duration::from_secs(2);
/// The pings' timeout: far beyond what the tests wait, so a stopped shard can only be found
/// down by its lease.
const DOWN_AFTER_MS: u64 = 60_000;
const BLOCK_BYTES: u64 = 4096;
const VOLUME_BYTES: u64 = 64 << 20;

/// Every process the test starts, killed by PID when the test ends, however it ends.
#[derive(Default)]
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn spawn(&mut self, name: &str, args: &[String], dir: &Path) {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_understudy"));
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        self.0.push((name.to_string(), cmd.spawn().unwrap()));
    }

    fn pid(&self, name: &str) -> u32 {
        self.0.iter().find(|(n, _)| n == name).unwrap().1.id()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn pattern(offset: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES as usize];
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((offset / BLOCK_BYTES) as u8).wrapping_mul(29).wrapping_add(i as u8) | 1;
    }
    b
}

/// A TCP relay in front of one etcd member: forwards while open; once cut, accepts connections
/// and never answers them (a partition, as a client sees it: no reset, only silence).
struct Relay {
    addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(to: String, cut: Arc<AtomicBool>) -> Relay {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let c = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                let (to, cut) = (to.clone(), c.clone());
                tokio::spawn(async move {
                    if cut.load(Ordering::SeqCst) {
                        // Held unanswered for longer than any request waits.
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        return;
                    }
                    if let Ok(mut out) = tokio::net::TcpStream::connect(&to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
            }
        });
        Relay { addr, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Bed {
    procs: Procs,
    store: control::Store,
    c: Arc<Cluster>,
    tmp: tempfile::TempDir,
    /// The relays shard 2's etcd traffic goes through, and their switch.
    _relays: Vec<Relay>,
    relays_cut: Arc<AtomicBool>,
    // Last: dropped after the processes that use it.
    _etcd: testbed::etcd::EtcdCluster,
}

impl Bed {
    fn dir(&self) -> &Path {
        self.tmp.path()
    }

    async fn map(&self) -> volume::types::ClusterMap {
        match self.c.meta(MetaReq::GetMap).await.unwrap() {
            MetaResp::Map(m) => m,
            r => panic!("{r:?}"),
        }
    }

    /// Waits until shard `id` is in `state`; returns how long that took.
    async fn wait_state(&self, id: u32, state: ShardState, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if self.map().await.state(id) == state {
                return start.elapsed();
            }
            assert!(start.elapsed() < timeout, "shard {id} not {state:?} within {timeout:?}: {:?}\n{}", self.map().await, self.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn logs(&self) -> String {
        self.procs
            .0
            .iter()
            .map(|(n, _)| format!("--- {n}:\n{}", testbed::proc::tail(&self.dir().join(format!("{n}.log")), 15)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// One metadata service ("meta") on a real 3-member etcd, or with `standby` two ("meta-a"
/// leading, "meta-b" standing by); three leased shards, shard 2's etcd traffic through the
/// relays; a client (following the leader with `standby`); a volume "vol".
async fn bed(standby: bool) -> Bed {
    // Started on this thread: the members die with the thread that started them.
    let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let secret = format!("shard-lease-{}-{:?}", std::process::id(), std::time::SystemTime::now());
    let sf = dir.join("secret");
    std::fs::write(&sf, &secret).unwrap();
    std::fs::set_permissions(&sf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let sf = sf.to_str().unwrap().to_string();
    let ports = wire::ports::free_loopback_ports(5).unwrap();
    let addr = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let meta = if standby { format!("{},{}", addr(0), addr(4)) } else { addr(0) };
    let cluster_id = cluster_id_from_secret(secret.as_bytes());
    let store = control::Store::open(&etcd.url(), "volume", &cluster_id).await.unwrap();
    let relays_cut = Arc::new(AtomicBool::new(false));
    let mut relays = Vec::new();
    for e in etcd.endpoints() {
        relays.push(Relay::start(e, relays_cut.clone()).await);
    }
    let relayed = format!("etcd://{}", relays.iter().map(|r| r.addr.clone()).collect::<Vec<_>>().join(","));
    let mut procs = Procs::default();
    let meta_args = |listen: &str| {
        s(&[
            "meta", "--store", &etcd.url(), "--listen", listen, "--secret-file", &sf, "--election-ttl-ms", &ELECTION_TTL.as_millis().to_string(),
            "--replicas", "2", "--ping-interval-ms", "100", "--down-after-ms", &DOWN_AFTER_MS.to_string(),
        ])
    };
    if standby {
        procs.spawn("meta-a", &meta_args(&addr(0)), &dir);
        wait_leader(&store, &addr(0), Duration::from_secs(30)).await;
        procs.spawn("meta-b", &meta_args(&addr(4)), &dir);
    } else {
        procs.spawn("meta", &meta_args(&addr(0)), &dir);
    }
    for i in 0..3 {
        let d = dir.join(format!("shard-{i}"));
        let url = if i == 2 { relayed.clone() } else { etcd.url() };
        let args = s(&[
            "shard", "--id", &i.to_string(), "--dir", d.to_str().unwrap(), "--listen", &addr(1 + i), "--meta", &meta,
            "--secret-file", &sf, "--create", "--store", &url, "--lease-ttl-ms", &LEASE_TTL.as_millis().to_string(),
        ]);
        procs.spawn(&format!("shard-{i}"), &args, &dir);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let c = loop {
        let c = if standby {
            let w = volume::driver::leader::LeaderWatch::spawn(etcd.url(), "volume".into(), cluster_id.clone());
            Cluster::connect_following(&meta, secret.as_bytes(), w).await
        } else {
            Cluster::connect(&meta, secret.as_bytes()).await
        };
        match c {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "no metadata service at {meta}: {e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let bed = Bed { procs, store, c, tmp, _relays: relays, relays_cut, _etcd: etcd };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = bed.map().await;
        if m.shards.len() == 3 && m.shards.iter().all(|s| s.state == ShardState::Up) {
            break;
        }
        assert!(Instant::now() < deadline, "the shards did not come up: {m:?}\n{}", bed.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let live = bed.store.live("shard").await.unwrap();
    assert_eq!(live.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["0", "1", "2"], "every shard registered: {live:?}");
    bed.c
        .meta(MetaReq::Create { name: "vol".into(), size_bytes: VOLUME_BYTES, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES })
        .await
        .unwrap();
    bed
}

/// Writes each block once, recording the acknowledged ones with their time.
struct Writer {
    acked: Arc<Mutex<BTreeMap<u64, Instant>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    async fn start(c: &Arc<Cluster>) -> Writer {
        let vol = Arc::new(c.open("vol").await.unwrap());
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
        Writer { acked, stop, task }
    }

    /// Stops; checks every acknowledged block reads back through a fresh client; returns the
    /// acknowledgement times.
    async fn finish(self, c: &Arc<Cluster>) -> BTreeMap<u64, Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let acked = self.acked.lock().unwrap().clone();
        let vol = c.open("vol").await.unwrap();
        for &off in acked.keys() {
            assert_eq!(vol.read(off, BLOCK_BYTES as u32).await.unwrap(), pattern(off), "acknowledged block at {off} lost");
        }
        acked
    }
}

/// Waits until the metadata leader advertises `want`; returns how long that took.
async fn wait_leader(store: &control::Store, want: &str, timeout: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if store.observe(volume::driver::meta::META_ELECTION).await.ok().flatten().as_deref() == Some(want) {
            return start.elapsed();
        }
        assert!(start.elapsed() < timeout, "{want} did not lead within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// When `needle` first shows in `log` (polled every 10 ms), or None after `timeout`.
async fn wait_log(log: &Path, needle: &str, from: usize, timeout: Duration) -> Option<Instant> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if std::fs::read_to_string(log).unwrap_or_default().get(from..).is_some_and(|s| s.contains(needle)) {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

fn log_len(p: &PathBuf) -> usize {
    std::fs::metadata(p).map(|m| m.len() as usize).unwrap_or(0)
}

/// One bed at a time: two (8 processes and two etcd clusters) on a loaded 2-core machine would
/// make each other's timings slow.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_shard_is_marked_down_when_its_lease_expires_and_writes_go_on() {
    let _serial = SERIAL.lock().await;
    let bed = bed(false).await;
    let writer = Writer::start(&bed.c).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    // Its links stay open and the pings' timeout is a minute: only the lease can tell.
    let pid = bed.procs.pid("shard-1");
    let stopped = Instant::now();
    assert!(testbed::proc::signal(pid, libc::SIGSTOP));
    let down = bed.wait_state(1, ShardState::Down, LEASE_TTL * 4 + Duration::from_secs(3)).await;
    let gone = bed.store.live("shard").await.unwrap();
    assert!(!gone.iter().any(|(id, _)| id == "1"), "marked down while its lease is still listed: {gone:?}");
    let meta_log = std::fs::read_to_string(bed.dir().join("meta.log")).unwrap();
    assert!(meta_log.contains("shard 1 down: its lease in the control store expired"), "{meta_log}");
    // Writes go on without it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let acked = writer.finish(&bed.c).await;
    let after = acked.values().filter(|t| **t > stopped + down).count();
    eprintln!(
        "stopped shard: marked down {} ms after SIGSTOP (lease TTL {} ms, ratio {:.2}); {} blocks acknowledged ({after} after), all read back; load {}",
        down.as_millis(),
        LEASE_TTL.as_millis(),
        down.as_secs_f64() / LEASE_TTL.as_secs_f64(),
        acked.len(),
        load.trim()
    );
    assert!(after > 10, "too few writes acknowledged after the shard was marked down: {after}");
    // Its lease was renewed a third of the TTL before the stop at the latest, so it cannot be
    // gone much sooner than two thirds of the TTL after it.
    assert!(down >= LEASE_TTL / 2, "marked down {down:?} after the stop: not by its lease");
    assert!(testbed::proc::signal(pid, libc::SIGKILL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_cut_off_from_etcd_fences_itself_before_it_is_marked_down() {
    let _serial = SERIAL.lock().await;
    let bed = bed(false).await;
    let writer = Writer::start(&bed.c).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let log = bed.dir().join("shard-2.log");
    let from = log_len(&log);
    let cut = Instant::now();
    bed.relays_cut.store(true, Ordering::SeqCst);
    let fenced = wait_log(&log, "fenced: refusing client I/O", from, LEASE_TTL * 3)
        .await
        .unwrap_or_else(|| panic!("shard 2 did not fence itself\n{}", bed.logs()))
        - cut;
    // The fence came first: when it shows, the metadata service has not yet moved the shard's
    // slots (it does so only once the lease expired, a third of the TTL later).
    let when_fenced = bed.map().await;
    assert_ne!(when_fenced.state(2), ShardState::Down, "marked down before it fenced itself: {when_fenced:?}\n{}", bed.logs());
    bed.wait_state(2, ShardState::Down, LEASE_TTL * 4 + Duration::from_secs(3)).await;
    let down = cut.elapsed();
    assert!(fenced < LEASE_TTL, "fenced {fenced:?} after the cut, not within the TTL {LEASE_TTL:?}");
    let meta_log = std::fs::read_to_string(bed.dir().join("meta.log")).unwrap();
    assert!(meta_log.contains("shard 2 down: its lease in the control store expired"), "{meta_log}");
    // While fenced, shard 2 answers a client's I/O with the fencing error (asked directly, at
    // the epoch it last knew, as a client with an old map would).
    let fenced_reply = direct_write_to(&bed, 2).await;
    assert!(fenced_reply.contains("fenced itself"), "{fenced_reply}");

    // Healed: it registers under a new lease, is re-admitted (recovering, then up) and serves.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let from = log_len(&log);
    let healed = Instant::now();
    bed.relays_cut.store(false, Ordering::SeqCst);
    let up = bed.wait_state(2, ShardState::Up, Duration::from_secs(30)).await;
    assert!(wait_log(&log, "fence lifted", from, Duration::from_secs(10)).await.is_some(), "{}", bed.logs());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let acked = writer.finish(&bed.c).await;
    let during = acked.values().filter(|t| **t > cut + down && **t < healed).count();
    // Nothing went to shard 2 as a primary between its fence and its removal, so the writes
    // acknowledged then were on shards 0 and 1: they all read back (checked above).
    eprintln!(
        "cut-off shard: fenced {} ms after its etcd link was cut, marked down {} ms after (lease TTL {} ms); \
         {during} writes acknowledged while it was out; up again {} ms after the heal; {} blocks acknowledged, all read back; load {}",
        fenced.as_millis(),
        down.as_millis(),
        LEASE_TTL.as_millis(),
        up.as_millis(),
        acked.len(),
        load.trim()
    );
    assert!(during > 10, "too few writes acknowledged while shard 2 was out: {during}");
}

/// Sends one write straight to shard `id` at the map's epoch (over a raw client connection)
/// and returns its answer, as text.
async fn direct_write_to(bed: &Bed, id: u32) -> String {
    use volume::types::{Hello, IoOp, Msg, VolRef};
    let map = bed.map().await;
    let addr = map.addr(id).unwrap().to_string();
    let secret = std::fs::read(bed.dir().join("secret")).unwrap();
    let info = bed.c.volume_info("vol").await.unwrap();
    let vol: VolRef = info.vol;
    let mut sock = volume::driver::shard::dial(&addr, &secret, &Hello::Client).await.unwrap();
    let msg = Msg::Io { req: 1, epoch: map.epoch, vol, objno: 0, op: IoOp::Write { offset: 0, data: vec![7; 512] } };
    wire::write_msg(&mut sock, &msg).await.unwrap();
    tokio::io::AsyncWriteExt::flush(&mut sock).await.unwrap();
    let reply: Msg = tokio::time::timeout(Duration::from_secs(5), wire::read_msg(&mut sock, wire::MAX_FRAME_PAYLOAD_BYTES)).await.unwrap().unwrap();
    format!("{reply:?}")
}

/// The metadata leader is paused (SIGSTOP): its connections stay open and its kernel accepts
/// new ones, so only the election tells. The standby takes over; the shards see the leader's
/// key change in etcd, leave the old one's link and register with the new one, which finds
/// them alive (their leases) and brings them up; the client follows too; writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_meta_leader_is_left_by_the_shards_which_follow_the_new_one() {
    let _serial = SERIAL.lock().await;
    let bed = bed(true).await;
    let metas: Vec<String> = bed.c.meta_addr().split(',').map(str::to_string).collect();
    let writer = Writer::start(&bed.c).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let pid = bed.procs.pid("meta-a");
    let paused = Instant::now();
    assert!(testbed::proc::signal(pid, libc::SIGSTOP));
    let takeover = wait_leader(&bed.store, &metas[1], 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    // The new leader starts with every shard down; each is up again only once it registered
    // with it (and its lease is live).
    let deadline = Instant::now() + Duration::from_secs(30);
    let all_up = loop {
        if let Ok(MetaResp::Map(m)) = bed.c.meta(MetaReq::GetMap).await {
            if m.shards.len() == 3 && m.shards.iter().all(|s| s.state == ShardState::Up) {
                break paused.elapsed();
            }
        }
        assert!(Instant::now() < deadline, "the shards did not come up under the new leader\n{}", bed.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for i in 0..3 {
        let log = std::fs::read_to_string(bed.dir().join(format!("shard-{i}.log"))).unwrap();
        assert!(log.contains(&format!("the metadata leader is now {}", metas[1])), "shard {i} did not follow:\n{log}");
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let acked = writer.finish(&bed.c).await;
    let after = acked.values().filter(|t| **t > paused + all_up).count();
    eprintln!(
        "paused meta leader: standby leads {} ms after SIGSTOP (election TTL {} ms), every shard up under it {} ms after; \
         {} blocks acknowledged ({after} after), all read back; load {}",
        takeover.as_millis(),
        ELECTION_TTL.as_millis(),
        all_up.as_millis(),
        acked.len(),
        load.trim()
    );
    assert!(after > 10, "too few writes acknowledged under the new leader: {after}");
    assert!(testbed::proc::signal(pid, libc::SIGKILL));
}
