//! The volume metadata service with a standby on a real 3-member etcd (`volume meta --store`):
//! two services, three shards given both addresses (`--meta A,B`), a client writing a volume
//! through the repo's client library. The leader is SIGKILLed mid-write; the standby takes over
//! (binds its address, loads the state the leader kept in etcd as keys), the shards and the
//! client find it, create / super / collapse are served again, and every acknowledged block
//! reads back.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blockdev::BlockDev;
use volume::driver::client::Cluster;
use volume::driver::meta::{cluster_id_from_secret, MetaReq, MetaResp, META_ELECTION};

/// The metadata services' election lease.
const ELECTION_TTL: Duration = Duration::from_secs(2);
/// The writer's block.
const BLOCK_BYTES: u64 = 4096;
const VOLUME_BYTES: u64 = 64 << 20;

/// Every process the test starts, killed by PID when the test ends, however it ends.
#[derive(Default)]
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn spawn(&mut self, name: &str, args: &[String], dir: &std::path::Path) {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_understudy"));
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        self.0.push((name.to_string(), cmd.spawn().unwrap()));
    }

    fn kill(&mut self, name: &str) {
        let i = self.0.iter().position(|(n, _)| n == name).unwrap();
        let (_, mut c) = self.0.remove(i);
        let _ = c.kill();
        let _ = c.wait();
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

async fn wait_leader(store: &control::Store, want: &str, timeout: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if store.observe(META_ELECTION).await.ok().flatten().as_deref() == Some(want) {
            return start.elapsed();
        }
        assert!(start.elapsed() < timeout, "{want} did not lead within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of whichever service leads. An elected service binds its address just after its
/// election shows in etcd: a client that comes in between finds nobody listening, and tries again.
async fn connect(metas: &str, secret: &str) -> Arc<Cluster> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Cluster::connect(metas, secret.as_bytes()).await {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "no metadata service answered at {metas}: {e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pattern(offset: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES as usize];
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((offset / BLOCK_BYTES) as u8).wrapping_mul(31).wrapping_add(i as u8) | 1;
    }
    b
}

/// Two metadata services (meta-a leading, meta-b standing by) on a real 3-member etcd, three
/// shards given both addresses, a client, and a volume "vol".
struct Bed {
    procs: Procs,
    store: control::Store,
    c: Arc<Cluster>,
    metas: String,
    secret: String,
    tmp: tempfile::TempDir,
    // Last: dropped after the processes that use it.
    etcd: testbed::etcd::EtcdCluster,
}

async fn bed() -> Bed {
    bed_advertising(false).await
}

/// [`bed`]; with `addresses`, each service advertises its address (the default of `--advertise`)
/// rather than a name, so clients that follow the election dial the leader first.
async fn bed_advertising(addresses: bool) -> Bed {
    // Started on this thread: the members die with the thread that started them.
    let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let secret = format!("meta-standby-{}-{:?}", std::process::id(), std::time::SystemTime::now());
    let sf = dir.join("secret");
    std::fs::write(&sf, &secret).unwrap();
    std::fs::set_permissions(&sf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let sf = sf.to_str().unwrap().to_string();
    let ports = wire::ports::free_loopback_ports(5).unwrap();
    let addr = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let (meta_a, meta_b) = (addr(0), addr(1));
    let metas = format!("{meta_a},{meta_b}");
    let store = control::Store::open(&etcd.url(), "volume", &cluster_id_from_secret(secret.as_bytes())).await.unwrap();
    let mut procs = Procs::default();
    let (name_a, name_b) = if addresses { (meta_a.clone(), meta_b.clone()) } else { ("meta-a".to_string(), "meta-b".to_string()) };
    let meta_args = |name: &str, listen: &str| {
        s(&[
            "meta", "--store", &etcd.url(), "--listen", listen, "--advertise", name, "--secret-file", &sf,
            "--election-ttl-ms", &ELECTION_TTL.as_millis().to_string(), "--replicas", "2",
            "--ping-interval-ms", "100", "--down-after-ms", "3000",
        ])
    };
    procs.spawn("meta-a", &meta_args(&name_a, &meta_a), dir);
    wait_leader(&store, &name_a, Duration::from_secs(30)).await;
    procs.spawn("meta-b", &meta_args(&name_b, &meta_b), dir);
    for i in 0..3 {
        let d = dir.join(format!("shard-{i}"));
        let args = s(&[
            "shard", "--id", &i.to_string(), "--dir", d.to_str().unwrap(), "--listen", &addr(2 + i), "--meta", &metas,
            "--secret-file", &sf, "--create",
        ]);
        procs.spawn(&format!("shard-{i}"), &args, dir);
    }
    let c = connect(&metas, &secret).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let MetaResp::Map(m) = c.meta(MetaReq::GetMap).await.unwrap() {
            if m.shards.len() == 3 && m.shards.iter().all(|s| s.state == volume::types::ShardState::Up) {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the shards did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.meta(MetaReq::Create { name: "vol".into(), size_bytes: VOLUME_BYTES, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES })
        .await
        .unwrap();
    // The state is in etcd as keys: one per volume.
    let vols = store.list(&store.prefix("volume", "vol")).await.unwrap();
    assert_eq!(vols.len(), 1, "one key per volume");
    assert!(store.get(&store.key("volume", "state", "gen")).await.unwrap().is_some());
    Bed { procs, store, c, metas, secret, tmp, etcd }
}

/// One bed at a time: two (8 processes and two etcd clusters) on a loaded 2-core machine would
/// make each other's takeovers slow.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_meta_takes_over_and_every_acknowledged_block_reads_back() {
    let _serial = SERIAL.lock().await;
    let Bed { mut procs, store, c, metas, secret, tmp: _tmp, etcd } = bed().await;

    // The writer: each block written once, its offset recorded once acknowledged.
    let vol = Arc::new(c.open("vol").await.unwrap());
    let acked: Arc<Mutex<BTreeMap<u64, Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (vol, acked, stop) = (vol.clone(), acked.clone(), stop.clone());
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
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let killed = Instant::now();
    procs.kill("meta-a");
    let takeover = wait_leader(&store, "meta-b", 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    // The next decision served: a create through the new leader (the client dials the list).
    let mut first_create = None;
    let deadline = killed + Duration::from_secs(30);
    while first_create.is_none() {
        match c.meta(MetaReq::Create { name: "side".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await {
            Ok(MetaResp::Volume(_)) => first_create = Some(killed.elapsed()),
            r => {
                assert!(Instant::now() < deadline, "no create served after the takeover: {r:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let first_create = first_create.unwrap();
    // Super and collapse through the new leader, on a volume of their own.
    let side = c.open("side").await.unwrap();
    side.write(0, pattern(0)).await.unwrap();
    let r = c.meta(MetaReq::Super { parent: "side".into(), child: "side-c".into() }).await.unwrap();
    assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
    let r = c.collapse("side-c", Duration::from_secs(30)).await.unwrap();
    assert!(matches!(r, MetaResp::Collapsed { .. }), "{r:?}");

    // Writes go on after the takeover.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    let acked = acked.lock().unwrap().clone();
    let after = acked.values().filter(|t| **t > killed + takeover).count();
    assert!(after > 10, "too few writes acknowledged after the takeover: {after}");
    // Every acknowledged block reads back, through a fresh client of the new leader.
    let c2 = connect(&metas, &secret).await;
    let vol2 = c2.open("vol").await.unwrap();
    for &off in acked.keys() {
        assert_eq!(vol2.read(off, BLOCK_BYTES as u32).await.unwrap(), pattern(off), "block at {off} lost");
    }
    let vols = store.list(&store.prefix("volume", "vol")).await.unwrap();
    assert!(vols.len() >= 2, "the new leader keeps its volumes in etcd: {vols:?}");
    eprintln!(
        "meta takeover: standby leads {} ms after the leader's SIGKILL (election TTL {} ms, ratio {:.2}); first create served {} ms after; \
         {} blocks acknowledged ({after} after the takeover), all read back; load {}",
        takeover.as_millis(),
        ELECTION_TTL.as_millis(),
        takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
        first_create.as_millis(),
        acked.len(),
        load.trim()
    );
    assert!(takeover <= 3 * ELECTION_TTL, "takeover took {takeover:?}");
    drop(procs);
    drop(etcd);
}

/// A leader stopped (SIGSTOP) past its election lease is replaced; continued, it finds its lease
/// gone and exits (status 75) without writing: the generation in etcd moves only by the new
/// leader, and decisions go on through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_meta_exits_when_it_wakes_and_cannot_write() {
    let _serial = SERIAL.lock().await;
    let Bed { mut procs, store, metas, secret, tmp, etcd, .. } = bed().await;
    let i = procs.0.iter().position(|(n, _)| n == "meta-a").unwrap();
    let pid = procs.0[i].1.id();
    assert!(testbed::proc::signal(pid, libc::SIGSTOP));
    let takeover = wait_leader(&store, "meta-b", 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    // A fresh client dials meta-a first: its kernel accepts, its handshake never comes, and the
    // client moves on to meta-b.
    let c = connect(&metas, &secret).await;
    let r = c.meta(MetaReq::Create { name: "during".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
    assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
    let gen_before = store.get(&store.key("volume", "state", "gen")).await.unwrap().unwrap().value;
    assert!(testbed::proc::signal(pid, libc::SIGCONT));
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(st) = procs.0[i].1.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the woken leader did not exit: {}", testbed::proc::tail(&tmp.path().join("meta-a.log"), 10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(volume::driver::meta::EXIT_NOT_LEADER), "{}", testbed::proc::tail(&tmp.path().join("meta-a.log"), 10));
    let log = std::fs::read_to_string(tmp.path().join("meta-a.log")).unwrap();
    assert!(log.contains("no longer leading"), "{log}");
    assert_eq!(store.observe(META_ELECTION).await.unwrap().as_deref(), Some("meta-b"));
    // Nothing of meta-a's landed: what etcd holds is what meta-b wrote, and meta-b goes on.
    let gen_after = store.get(&store.key("volume", "state", "gen")).await.unwrap().unwrap().value;
    let r = c.meta(MetaReq::Create { name: "after".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
    assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
    let names: Vec<String> = match c.meta(MetaReq::List).await.unwrap() {
        MetaResp::Volumes(v) => v.into_iter().map(|v| v.name).collect(),
        r => panic!("{r:?}"),
    };
    assert_eq!(names, ["after", "during", "vol"]);
    eprintln!(
        "paused leader: standby leads {} ms after SIGSTOP; the woken one exited {:?} (generation {} -> {} meanwhile, by meta-b only)",
        takeover.as_millis(),
        status,
        String::from_utf8_lossy(&gen_before),
        String::from_utf8_lossy(&gen_after)
    );
    drop(procs);
    drop(etcd);
}

/// Issue 24: a client whose kept connection reaches a leader gone silent (stopped here; a dead
/// host is as silent) sent its next request on it and gave up after the 10 s reply timeout,
/// after the standby had taken over. Now a request that changes something probes an idle
/// connection first and goes to the new leader; a read is asked again on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_idle_on_a_silent_leader_reaches_the_new_one() {
    let _serial = SERIAL.lock().await;
    let Bed { procs, store, c, metas, secret, etcd, .. } = bed().await;
    let reader = connect(&metas, &secret).await;
    let i = procs.0.iter().position(|(n, _)| n == "meta-a").unwrap();
    let pid = procs.0[i].1.id();
    assert!(testbed::proc::signal(pid, libc::SIGSTOP));
    let takeover = wait_leader(&store, "meta-b", 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let asked = Instant::now();
    let r = c
        .meta(MetaReq::Create { name: "after".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES })
        .await
        .expect("the create goes to the new leader, not lost on the silent one's connection");
    assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
    let create_ms = asked.elapsed().as_millis();
    // The same for a read, on a client whose connection went silent while it was kept.
    let r = reader.meta(MetaReq::GetMap).await.expect("the read is asked again of the new leader");
    assert!(matches!(r, MetaResp::Map(_)), "{r:?}");
    eprintln!("silent leader: standby leads {} ms after SIGSTOP; the idle client's create served {create_ms} ms after it was asked; load {}", takeover.as_millis(), load.trim());
    drop(procs);
    drop(etcd);
}

/// Issue 24 (the host-loss stall of `bench control failover`): a client following the election
/// dialled its address list while the leader's host was dead; each silent address cost the whole
/// per-address dial timeout, and a leader elected meanwhile was reached only once the list got
/// to it (the writer's map refresh waited 2 s on the dead host after the new leader served). Now
/// a dial is started again, the new leader first, as soon as the election changes. Here: the
/// leader stopped (its kernel accepts, its handshake never comes) and six listeners that never
/// answer ahead of the standby in the list: 14 s of dial timeouts before the standby, against a
/// takeover of about the 2 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_through_silent_addresses_starts_again_at_the_new_leader() {
    let _serial = SERIAL.lock().await;
    let Bed { procs, store, metas, secret, etcd, .. } = bed_advertising(true).await;
    let (meta_a, meta_b) = metas.split_once(',').unwrap();
    let watch = volume::driver::leader::LeaderWatch::spawn(etcd.url(), "volume".into(), cluster_id_from_secret(secret.as_bytes()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while watch.current().map(|l| l.addr).as_deref() != Some(meta_a) {
        assert!(Instant::now() < deadline, "the watch did not see meta-a lead");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Accepted by the kernel into the backlog, never answered: a dial waits its whole timeout.
    let silent: Vec<std::net::TcpListener> = (0..6).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let silent_addrs: Vec<String> = silent.iter().map(|l| l.local_addr().unwrap().to_string()).collect();
    let list = format!("{},{meta_b},{meta_a}", silent_addrs.join(","));
    let i = procs.0.iter().position(|(n, _)| n == "meta-a").unwrap();
    assert!(testbed::proc::signal(procs.0[i].1.id(), libc::SIGSTOP));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let stopped = Instant::now();
    // Dialled in the order meta-a (the leader the watch knows), the silent six, meta-b.
    let c = Cluster::connect_following(&list, secret.as_bytes(), watch).await.expect("a client reaches the new leader");
    let connected = stopped.elapsed();
    let takeover = wait_leader(&store, meta_b, Duration::from_secs(1)).await;
    assert!(matches!(c.meta(MetaReq::GetMap).await.unwrap(), MetaResp::Map(_)));
    eprintln!("silent addresses: connected {} ms after SIGSTOP (meta-b leading by then: {takeover:?}); load {}", connected.as_millis(), load.trim());
    // Failure mode: 7 x META_DIAL_TIMEOUT (14 s). Taking over needs the 2 s lease to run out.
    assert!(connected < Duration::from_secs(9), "the dial went through every silent address first: {connected:?}");
    drop(silent);
    drop(procs);
    drop(etcd);
}
