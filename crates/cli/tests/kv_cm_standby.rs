//! The kv configuration manager with a standby on a real 3-member etcd (issue 24, item 2): two
//! `kv cm --store etcd://...` processes and a 3-node group, all real processes on loopback. Under
//! a put/get load the leading CM is killed with SIGKILL; the standby takes over (from the
//! configuration the leader kept in etcd), the group serves again, every operation's history
//! passes the linearizability checker, the killed CM, restarted, stands by, and the new leader
//! reconfigures the group through etcd when a node dies.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::checker::{self, Op, OpKind};
use kv::leaderless::driver::{cluster_id_from_secret, KvCluster, CM_ELECTION};

/// The CMs' election lease.
const ELECTION_TTL: Duration = Duration::from_secs(2);
/// The nodes' read lease.
const NODE_LEASE_MS: u64 = 300;

/// Every process the test starts, killed by PID when the test ends, however it ends.
#[derive(Default)]
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn spawn(&mut self, name: &str, args: &[String], dir: &std::path::Path) -> u32 {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_understudy"));
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        let child = cmd.spawn().unwrap();
        let pid = child.id();
        self.0.push((name.to_string(), child));
        pid
    }

    fn kill(&mut self, name: &str) {
        let i = self.0.iter().position(|(n, _)| n == name).unwrap();
        let (_, mut c) = self.0.remove(i);
        let _ = c.kill();
        let _ = c.wait();
    }

    fn pid(&self, name: &str) -> u32 {
        self.0.iter().find(|(n, _)| n == name).unwrap().1.id()
    }

    fn alive(&mut self, name: &str) -> bool {
        self.0.iter_mut().any(|(n, c)| n == name && matches!(c.try_wait(), Ok(None)))
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

fn cm_args(name: &str, nodes: &str, secret: &str, store: &str) -> Vec<String> {
    [
        "kv", "cm", "--nodes", nodes, "--secret-file", secret, "--store", store,
        "--election-ttl-ms", &ELECTION_TTL.as_millis().to_string(), "--advertise", name,
        "--lease-ms", &NODE_LEASE_MS.to_string(),
        // Generous against a loaded machine: no node dies in this test.
        "--failure-timeout-ms", "3000", "--startup-grace-ms", "10000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn leader(store: &control::Store) -> Option<String> {
    store.observe(CM_ELECTION).await.ok().flatten()
}

async fn wait_leader(store: &control::Store, want: &str, timeout: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if leader(store).await.as_deref() == Some(want) {
            return start.elapsed();
        }
        assert!(start.elapsed() < timeout, "{want} did not lead within {timeout:?} (leader: {:?})", leader(store).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A 3-node group, its two CMs (cm-a leading, cm-b standing by) on a real 3-member etcd.
struct Group {
    procs: Procs,
    store: control::Store,
    client: KvCluster,
    nodes: String,
    sf: String,
    tmp: tempfile::TempDir,
    // Last: dropped after the processes that use it.
    etcd: testbed::etcd::EtcdCluster,
}

async fn group() -> Group {
    // Started on this thread, not a blocking-pool one: the members die with the thread that
    // started them (their parent-death signal), and a pool thread ends when it is idle.
    let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let secret = format!("cm-standby-{}-{:?}", std::process::id(), std::time::SystemTime::now());
    let sf = dir.join("secret");
    std::fs::write(&sf, &secret).unwrap();
    std::fs::set_permissions(&sf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let sf = sf.to_str().unwrap().to_string();
    let ports = wire::ports::free_loopback_ports(3).unwrap();
    let addrs: Vec<std::net::SocketAddr> = ports.iter().map(|p| format!("127.0.0.1:{p}").parse().unwrap()).collect();
    let nodes: String = addrs.iter().enumerate().map(|(i, a)| format!("{i}={a}")).collect::<Vec<_>>().join(",");
    let mut procs = Procs::default();
    for i in 0..3 {
        let data = dir.join(format!("node-{i}"));
        let args: Vec<String> = [
            "kv", "node", "--id", &i.to_string(), "--peers", &nodes, "--data", data.to_str().unwrap(),
            "--secret-file", &sf, "--lease-ms", &NODE_LEASE_MS.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        procs.spawn(&format!("node-{i}"), &args, dir);
    }
    let store = control::Store::open(&etcd.url(), "kv", &cluster_id_from_secret(secret.as_bytes())).await.unwrap();
    procs.spawn("cm-a", &cm_args("cm-a", &nodes, &sf, &etcd.url()), dir);
    wait_leader(&store, "cm-a", Duration::from_secs(30)).await;
    procs.spawn("cm-b", &cm_args("cm-b", &nodes, &sf, &etcd.url()), dir);

    let c = KvCluster::new(addrs.clone(), secret.as_bytes().to_vec());
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"warmup", b"1").await.is_err() || c.get(b"warmup").await.is_err() {
        assert!(Instant::now() < deadline, "the group never served");
    }
    assert_eq!(leader(&store).await.as_deref(), Some("cm-a"), "cm-b must stand by while cm-a leads");
    // The configuration is in etcd as keys, not a blob.
    let epoch = store.get(&store.key("kv", "cm", "epoch")).await.unwrap().expect("the leader persisted its epoch");
    assert_eq!(epoch.value, b"1");
    assert_eq!(store.list(&store.prefix("kv", "node")).await.unwrap().len(), 3);
    Group { procs, store, client: c, nodes, sf, tmp, etcd }
}

/// Operations recorded for the checker, and the clock they are timed on.
struct Load {
    history: Arc<Mutex<Vec<Op>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    t0: Instant,
}

impl Load {
    fn us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Stops the clients; checks the history; returns it.
    async fn finish(self) -> Vec<Op> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let history = self.history.lock().unwrap().clone();
        if let Err(v) = checker::check(&history) {
            panic!("{v}");
        }
        history
    }
}

/// 4 clients, puts and gets on 16 keys, every operation recorded.
fn load(c: &KvCluster) -> Load {
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
                    Op { client, key, call_us, ret_us: r.is_ok().then(us), kind: OpKind::Put(val) }
                } else {
                    match c.get(&key).await {
                        Ok(v) => Op { client, key, call_us, ret_us: Some(us()), kind: OpKind::Get(v) },
                        // A read with no answer constrains nothing.
                        Err(_) => continue,
                    }
                };
                history.lock().unwrap().push(op);
            }
        }));
    }
    Load { history, stop, tasks, t0 }
}

/// Operations of each kind served (answered) that were called after `after_us`.
fn served_after(history: &[Op], after_us: u64, put: bool) -> usize {
    history.iter().filter(|o| o.call_us > after_us && o.ret_us.is_some() && matches!(o.kind, OpKind::Put(_)) == put).count()
}

/// One group at a time: two (6 processes and two etcd clusters) on a loaded 2-core machine
/// would make each other's takeovers slow.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_cm_takes_over_under_load_and_the_history_is_linearizable() {
    let _serial = SERIAL.lock().await;
    let g = group().await;
    let Group { mut procs, store, client: c, nodes, sf, tmp, etcd } = g;
    let dir = tmp.path();
    let l = load(&c);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let killed_us = l.us();
    procs.kill("cm-a");
    let takeover = wait_leader(&store, "cm-b", 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    let elected_us = killed_us + takeover.as_micros() as u64;
    // The load goes on after the takeover: reads need the new leader's heartbeats (leases).
    tokio::time::sleep(Duration::from_millis(2500)).await;

    // The new leader carried on from the configuration it read (no node was lost: same epoch).
    let epoch = store.get(&store.key("kv", "cm", "epoch")).await.unwrap().unwrap();
    assert_eq!(epoch.value, b"1", "no reconfiguration was needed");

    // The killed CM, restarted, stands by: it does not lead for two election TTLs.
    procs.spawn("cm-a2", &cm_args("cm-a", &nodes, &sf, &etcd.url()), dir);
    let until = Instant::now() + 2 * ELECTION_TTL;
    while Instant::now() < until {
        assert_eq!(leader(&store).await.as_deref(), Some("cm-b"), "the restarted CM must stand by");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(procs.alive("cm-a2"), "the restarted CM exited: {}", std::fs::read_to_string(dir.join("cm-a2.log")).unwrap_or_default());
    let a2_log = std::fs::read_to_string(dir.join("cm-a2.log")).unwrap();
    assert!(a2_log.contains("standing for leadership") && !a2_log.contains("cm: leading"), "{a2_log}");
    // The new leader decides: a node killed now is removed, by a configuration written to etcd
    // under the new leader's guard (epoch 1 -> 2), and the group goes on with two nodes.
    let node_killed_us = l.us();
    procs.kill("node-2");
    let node_killed = Instant::now();
    loop {
        let epoch = store.get(&store.key("kv", "cm", "epoch")).await.unwrap().unwrap();
        let n2 = store.get(&store.key("kv", "node", "00002")).await.unwrap().unwrap();
        if epoch.value == b"2" && n2.value == b"removed" {
            break;
        }
        assert!(node_killed.elapsed() < Duration::from_secs(30), "the new leader never removed node 2: epoch {:?}", String::from_utf8_lossy(&epoch.value));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reconfigured = node_killed.elapsed();
    let reconfigured_us = l.us();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let history = l.finish().await;
    let (puts_then, gets_then) = (served_after(&history, reconfigured_us, true), served_after(&history, reconfigured_us, false));
    assert!(puts_then > 20 && gets_then > 20, "too few operations served after the reconfiguration: {puts_then} puts, {gets_then} gets");
    let (puts_after, gets_after) = (served_after(&history, elected_us, true), served_after(&history, elected_us, false));
    assert!(puts_after > 20 && gets_after > 20, "too few operations served after the takeover: {puts_after} puts, {gets_after} gets");
    // The longest time no read returned, from the CM's kill to the node's: the read pause the
    // takeover caused.
    let mut reads: Vec<u64> = history.iter().filter(|o| matches!(o.kind, OpKind::Get(_))).filter_map(|o| o.ret_us).collect();
    reads.sort_unstable();
    let read_pause_ms = reads.windows(2).filter(|w| w[1] > killed_us && w[0] < node_killed_us).map(|w| w[1] - w[0]).max().unwrap_or(0) / 1000;
    eprintln!(
        "kv cm takeover: standby leads {} ms after the leader's SIGKILL (election TTL {} ms, ratio {:.2}); \
         longest read pause {read_pause_ms} ms; {} ops ({puts_after} puts, {gets_after} gets after the takeover); load {}",
        takeover.as_millis(),
        ELECTION_TTL.as_millis(),
        takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
        history.len(),
        load_before.trim()
    );
    eprintln!("node 2 killed: removed by the new leader (epoch 2 in etcd) after {} ms (CM failure timeout 3000 ms)", reconfigured.as_millis());
    assert!(takeover <= 3 * ELECTION_TTL, "takeover took {takeover:?}");
    drop(procs);
    drop(etcd);
}

/// A leader stopped (SIGSTOP) past its election lease is replaced; continued, it finds its lease
/// lost, stops acting and stands by again, and the group's history stays linearizable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_cm_steps_down_when_it_wakes() {
    let _serial = SERIAL.lock().await;
    let Group { mut procs, store, client: c, tmp, etcd, .. } = group().await;
    let dir = tmp.path();
    let l = load(&c);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let pid = procs.pid("cm-a");
    assert!(testbed::proc::signal(pid, libc::SIGSTOP));
    let takeover = wait_leader(&store, "cm-b", 3 * ELECTION_TTL + Duration::from_secs(2)).await;
    // Some heartbeats of the new leader first, then the old one wakes up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(testbed::proc::signal(pid, libc::SIGCONT));
    let log = dir.join("cm-a.log");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log).unwrap().contains("no longer leading") {
        assert!(Instant::now() < deadline, "the woken CM did not step down: {}", std::fs::read_to_string(&log).unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let woke_us = l.us();
    let until = Instant::now() + ELECTION_TTL;
    while Instant::now() < until {
        assert_eq!(leader(&store).await.as_deref(), Some("cm-b"), "the woken CM must stand by");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(procs.alive("cm-a"), "the woken CM exited: {}", std::fs::read_to_string(&log).unwrap());
    let history = l.finish().await;
    let (puts, gets) = (served_after(&history, woke_us, true), served_after(&history, woke_us, false));
    assert!(puts > 20 && gets > 20, "too few operations served after the old leader woke: {puts} puts, {gets} gets");
    eprintln!("paused leader: standby leads {} ms after SIGSTOP; {} ops checked; the woken CM's log ends:\n{}", takeover.as_millis(), history.len(), testbed::proc::tail(&log, 6));
    drop(procs);
    drop(etcd);
}
