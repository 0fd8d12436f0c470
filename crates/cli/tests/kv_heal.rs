//! `understudy kv up` with real processes on loopback: under a write load, `kill -9` one node;
//! `kv up` restarts it on its log, it recovers through HEAL while the others keep serving, and
//! every acknowledged write survives (read through the group and through the recovered node).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::leaderless::proto::{ClientOp, ClientResult};
use kv::leaderless::driver::events::Event;
use kv::leaderless::driver::{KvClient, KvCluster, KvClusterFile};

struct Up {
    child: Child,
    dir: PathBuf,
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, nodes: u32) -> Up {
    // A killed node is back (and reported WantsJoin) within the restart delay, long before the
    // failure timeout: a generous timeout and lease cost nothing here, and keep a heavily loaded
    // machine from false suspicions that would restart the recovery.
    start_with(dir, nodes, &["--failure-timeout-ms", "2000", "--lease-ms", "800"])
}

fn start_with(dir: &Path, nodes: u32, extra: &[&str]) -> Up {
    let child = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["kv", "up", "--dir", dir.to_str().unwrap(), "--nodes", &nodes.to_string(), "--port-base", "0", "--restart-after-ms", "300"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.with_extension("up.log")).unwrap())
        .spawn()
        .unwrap();
    Up { child, dir: dir.to_path_buf() }
}

fn pid_of(dir: &Path, name: &str) -> u32 {
    let text = std::fs::read_to_string(dir.join("pids")).unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().trim().parse().unwrap()
}

async fn cluster(dir: &Path) -> (KvCluster, KvClusterFile, Vec<u8>) {
    let cf = dir.join("kv-cluster.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cf.exists() {
        assert!(Instant::now() < deadline, "kv up wrote no cluster file");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let f: KvClusterFile = serde_json::from_str(&std::fs::read_to_string(&cf).unwrap()).unwrap();
    let secret = std::fs::read_to_string(&f.secret_file).unwrap().trim().as_bytes().to_vec();
    let c = KvCluster::new(f.nodes.values().copied().collect(), secret.clone());
    (c, f, secret)
}

/// Per key: the last acknowledged value, and values written after it whose outcome is unknown.
type Acked = Arc<Mutex<HashMap<String, (Option<String>, Vec<String>)>>>;

/// One cluster at a time: two of them (8 nodes, their clients and load) on a 2-core machine
/// running a debug build are the likely cause of a recovery that once missed its 120 s deadline
/// in the full suite (the group took ~30 s to serve; not reproduced alone).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn kill9_recover(nodes: u32, victim: u32) {
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let up = start(&dir, nodes);
    let (c, f, secret) = cluster(&up.dir).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"warmup", b"1").await.is_err() {
        assert!(Instant::now() < deadline, "group never served");
    }
    let acked: Acked = Arc::new(Mutex::new(HashMap::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let c = c.clone();
        let acked = acked.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut ok = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let key = format!("t{t}-k{}", n % 40);
                let val = format!("t{t}-v{n}");
                match c.put(key.as_bytes(), val.as_bytes()).await {
                    Ok(()) => {
                        ok += 1;
                        // Earlier writes with unknown outcome stay possible: a pending write may
                        // still be replayed and linearized after this one.
                        acked.lock().unwrap().entry(key).or_insert((None, Vec::new())).0 = Some(val);
                    }
                    Err(_) => {
                        acked.lock().unwrap().entry(key).or_insert((None, Vec::new())).1.push(val);
                    }
                }
            }
            ok
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let pid = pid_of(&up.dir, &format!("node-{victim}"));
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    // The restarted node recovers through HEAL while the load goes on.
    let log = up.dir.join(format!("logs/node-{victim}.log"));
    // The node reports its recovery as a structured event on the file `kv up` names for it.
    let events = up.dir.join(format!("logs/node-{victim}.events"));
    let deadline = Instant::now() + Duration::from_secs(120);
    let recovered = loop {
        let got = kv::leaderless::driver::events::read_events(&events, 0).expect("the events file reads");
        if let Some(e) = got.into_iter().find(|e| matches!(e.event, Event::Recovered { node, .. } if node == victim)) {
            break e;
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(Instant::now() < deadline, "node {victim} did not recover; its log:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert!(total > 50, "too few writes acknowledged under load: {total}");
    // Every acknowledged write is there, through the group and through the recovered node.
    // Reads retry transient errors (a timeout or a refusal on a loaded machine) until a
    // deadline: only a wrong value fails at once.
    let mut direct = KvClient::connect(f.nodes[&victim], &secret).await.ok();
    let acked = acked.lock().unwrap().clone();
    for (key, (last, unknown)) in &acked {
        let deadline = Instant::now() + Duration::from_secs(30);
        let via_group = loop {
            match c.get(key.as_bytes()).await {
                Ok(v) => break v.map(|v| String::from_utf8(v).unwrap()),
                Err(e) => assert!(Instant::now() < deadline, "{key}: the group never answered: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let ok = |v: &Option<String>| v == last || v.as_ref().is_some_and(|v| unknown.contains(v));
        assert!(ok(&via_group), "{key}: read {via_group:?}, last acknowledged {last:?}");
        let via_victim = loop {
            let r = match &direct {
                Some(d) if !d.is_closed() => d.call(ClientOp::Get { key: key.as_bytes().to_vec() }).await.map_err(|e| e.to_string()),
                _ => {
                    direct = KvClient::connect(f.nodes[&victim], &secret).await.ok();
                    Err("not connected".into())
                }
            };
            match r {
                Ok(ClientResult::Value(v)) => break v.map(|v| String::from_utf8(v).unwrap()),
                Ok(ClientResult::NotServing | ClientResult::Busy) | Err(_) => {
                    assert!(Instant::now() < deadline, "recovered node {victim} never served again: {r:?}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(other) => panic!("unexpected {other:?}"),
            }
        };
        assert!(ok(&via_victim), "{key} on recovered node {victim}: read {via_victim:?}, last acknowledged {last:?}");
    }
    eprintln!("{nodes} nodes, {total} writes acknowledged, {} keys checked; {recovered:?}", acked.len());
    drop(up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_under_load_recovers_via_heal_5_nodes() {
    kill9_recover(5, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_under_load_recovers_via_heal_3_nodes() {
    kill9_recover(3, 0).await;
}

/// After `SIGCONT` the CM has stopped for [`CM_PAUSE`], writes are acknowledged again (50 of
/// them) within this bound. Expected: tens of milliseconds (the CM's first heartbeats give the
/// nodes their leases back); the unfixed CM never got there (issue 22 §2: it removed four nodes
/// and the group served nothing again).
const RESUME_BOUND: Duration = Duration::from_secs(3);
/// Three times `kv up`'s default failure timeout (500 ms), five times its lease (300 ms).
const CM_PAUSE: Duration = Duration::from_millis(1500);

/// Issue 22 §2: `kv up` (5 nodes, synch, its default failure timeout and lease) under a write
/// load; the CM is stopped with SIGSTOP for 1.5 s, then continued. Operations resume within
/// [`RESUME_BOUND`] and go on being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cm_stopped_past_the_failure_timeout_does_not_wedge_the_group() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let up = start_with(&dir, 5, &["--model", "synch"]);
    let (c, _f, _secret) = cluster(&up.dir).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"warmup", b"1").await.is_err() {
        assert!(Instant::now() < deadline, "group never served");
    }
    let ok = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (c, ok, stop) = (c.clone(), ok.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let (key, val) = (format!("t{t}-k{}", n % 40), format!("t{t}-v{n}"));
                if c.put(key.as_bytes(), val.as_bytes()).await.is_ok() {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while ok.load(Ordering::Relaxed) < 50 {
        assert!(Instant::now() < deadline, "no load before the pause");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let cm = pid_of(&up.dir, "cm") as i32;
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(cm, libc::SIGSTOP) }, 0);
    tokio::time::sleep(CM_PAUSE).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(cm, libc::SIGCONT) }, 0);
    let woke = Instant::now();
    let base = ok.load(Ordering::Relaxed);
    let mut first = None;
    let cm_log = || std::fs::read_to_string(up.dir.join("logs/cm.log")).unwrap_or_default();
    loop {
        let done = ok.load(Ordering::Relaxed) - base;
        if done > 0 && first.is_none() {
            first = Some(woke.elapsed());
        }
        if done >= 50 {
            break;
        }
        assert!(
            woke.elapsed() < RESUME_BOUND,
            "{done} writes acknowledged in the {RESUME_BOUND:?} after the CM was continued; its log:\n{}",
            cm_log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let resumed = woke.elapsed();
    // Not a blip before a wedge: the group goes on serving.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_second = ok.load(Ordering::Relaxed) - later;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let log = cm_log();
    let removed = log.lines().filter(|l| l.starts_with("cm:") && l.contains("removed")).count();
    eprintln!(
        "CM stopped {CM_PAUSE:?}: first write acknowledged {:?} after SIGCONT, 50 after {resumed:?}; \
         {last_second} writes in the last second; {removed} nodes removed",
        first.unwrap()
    );
    assert!(last_second >= 20, "the group stopped serving after the pause: {last_second} writes in 1 s; CM log:\n{log}");
    drop(up);
}

/// Issue 24 item 4: the CM SIGKILLed under `kv up` is started again on its durable state
/// (`kv up` says so), and the group serves again: earlier acknowledged writes read back, new
/// ones are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cm_killed_under_kv_up_is_restarted_and_the_group_serves() {
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let up = start(&dir, 3);
    let (c, _f, _secret) = cluster(&up.dir).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"before", b"1").await.is_err() {
        assert!(Instant::now() < deadline, "group never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cm = pid_of(&up.dir, "cm");
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(cm as i32, libc::SIGKILL) }, 0);
    let up_log = || std::fs::read_to_string(up.dir.with_extension("up.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let new_cm = loop {
        let p = pid_of(&up.dir, "cm");
        if p != cm && testbed::proc::alive(p) {
            break p;
        }
        assert!(Instant::now() < deadline, "the CM was not restarted within 30 s:\n{}", up_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"after", b"2").await.is_err() {
        assert!(Instant::now() < deadline, "the group does not serve again after the CM's restart:\n{}", up_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(c.get(b"before").await.unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(c.get(b"after").await.unwrap().as_deref(), Some(&b"2"[..]));
    let said = up_log();
    assert!(said.contains("cm exited") && said.contains(&format!("cm restarted (pid {new_cm})")), "kv up reports the exit and the restart:\n{said}");
    drop(up);
}

/// A CM that cannot start again (its state file is garbage) is restarted with a growing
/// backoff, then given up on: `kv up` names it and the cause, stops the group and exits
/// non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cm_that_keeps_failing_is_reported_and_kv_up_exits_non_zero() {
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let mut up = start(&dir, 3);
    let (c, _f, _secret) = cluster(&up.dir).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.put(b"k", b"v").await.is_err() {
        assert!(Instant::now() < deadline, "group never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let nodes: Vec<u32> = (0..3).map(|i| pid_of(&up.dir, &format!("node-{i}"))).collect();
    std::fs::write(up.dir.join("cm/cm.state"), b"not a state file").unwrap();
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid_of(&up.dir, "cm") as i32, libc::SIGKILL) }, 0);
    let up_log = || std::fs::read_to_string(up.dir.with_extension("up.log")).unwrap_or_default();
    // 250 ms + 0.5 + 1 + 2 + 4 s of backoff and six failed starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = up.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "kv up still runs 60 s after its CM began failing:\n{}", up_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let said = up_log();
    assert!(!status.success(), "kv up exited successfully:\n{said}");
    assert!(said.contains("cm keeps failing (6 exits within 60 s)") && said.contains("corrupt CM state"), "{said}");
    assert!(testbed::proc::wait_gone(&nodes, Duration::from_secs(30)), "nodes still run after kv up gave up");
}
