//! The witness KV's leader stopped with SIGSTOP (issue 25 item 8) under a small write and read
//! load, as real processes (`kv up --protocol witness`: primary, backup, witness):
//! - stopped for less than the hard timeout (300 ms here) but more than the soft one (30 ms):
//!   the successor starts its proactive pull, aborts it when the leader is heard again, and
//!   nobody is elected;
//! - stopped for well past the hard timeout: a witness is elected and serves; the old primary,
//!   resumed, answers no read (its lease ran out while it was stopped), so nothing stale.
//!
//! Every recorded history is checked for linearizability with `kv::checker`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::checker::{self, Op, OpKind};
use kv::witness::driver::{WitnessClient, WitnessError};
use testbed::kv_witness::WitnessClusterFile;
use testbed::proc;

mod witness_group;
use witness_group::*;

/// Resumes a stopped node when dropped (declared after `Up`, so before `kv up` stops the
/// group: a stopped node would not handle its SIGTERM).
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        proc::signal(self.0, libc::SIGCONT);
    }
}

fn node_log(dir: &Path, id: u32) -> String {
    std::fs::read_to_string(dir.join(format!("logs/node-{id}.log"))).unwrap_or_default()
}

/// Elections so far, over every node's log (a head logs each candidacy).
fn candidacies(dir: &Path) -> usize {
    (0..3).map(|i| node_log(dir, i).matches("Candidate").count()).sum()
}

const CLIENTS: u64 = 4;
const KEYS_PER_CLIENT: u64 = 8;

fn us(t0: Instant) -> u64 {
    t0.elapsed().as_micros() as u64
}

/// One closed-loop client: puts unique values to its own keys (half the ops) and gets keys of
/// every client, recording each op (`ret_us: None` = a put that may or may not have taken
/// effect; an unanswered get constrains nothing and is not recorded).
async fn load(c: u64, mut cl: WitnessClient, t0: Instant, stop: Arc<AtomicBool>, hist: Arc<Mutex<Vec<Op>>>) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let call_us = us(t0);
        let op = if i.is_multiple_of(2) {
            let key = format!("c{c}-k{}", (i / 2) % KEYS_PER_CLIENT).into_bytes();
            let value = format!("c{c}-v{i}").into_bytes();
            let r = cl.put(&key, &value).await;
            Op { client: c, key, call_us, ret_us: r.ok().map(|()| us(t0)), kind: OpKind::Put(value) }
        } else {
            let key = format!("c{}-k{}", (c + i) % CLIENTS, i % KEYS_PER_CLIENT).into_bytes();
            match cl.get(&key).await {
                Ok(v) => Op { client: c, key, call_us, ret_us: Some(us(t0)), kind: OpKind::Get(v) },
                Err(e) => {
                    assert!(!matches!(e, WitnessError::Refused(_)), "a get was refused: {e}");
                    continue;
                }
            }
        };
        hist.lock().unwrap().push(op);
    }
}

struct Load {
    t0: Instant,
    stop: Arc<AtomicBool>,
    hist: Arc<Mutex<Vec<Op>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(file: &WitnessClusterFile, secret: &[u8]) -> Load {
        let t0 = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let hist = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..CLIENTS)
            .map(|c| tokio::spawn(load(c, file.client(secret.to_vec()), t0, stop.clone(), hist.clone())))
            .collect();
        Load { t0, stop, hist, tasks }
    }

    fn acked_puts(&self) -> usize {
        self.hist.lock().unwrap().iter().filter(|o| o.ret_us.is_some() && matches!(o.kind, OpKind::Put(_))).count()
    }

    /// Stops the clients and checks the whole history (plus `extra` ops) for linearizability.
    async fn finish(self, extra: Vec<Op>) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            tokio::time::timeout(Duration::from_secs(30), t).await.expect("a load client hung").unwrap();
        }
        let mut history = self.hist.lock().unwrap().clone();
        history.extend(extra);
        if let Err(v) = checker::check(&history) {
            panic!("{v}");
        }
        history.len()
    }
}

/// The serving leader, as a client finds it.
async fn leader(file: &WitnessClusterFile, secret: &[u8]) -> u32 {
    let mut probe = file.client(secret.to_vec());
    probe.put(b"probe", b"p").await.unwrap();
    probe.leader_guess()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_stopped_shorter_than_the_hard_timeout_aborts_the_proactive_pull() {
    let (_t, dir) = disk_dir();
    let _up = start(&dir, &[]);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    let load = Load::start(&file, &secret);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(load.acked_puts() >= 20, "only {} puts acknowledged before the stop", load.acked_puts());
    // Node 0 unless a loaded machine's stall already caused an election; the other head is the
    // designated successor.
    let victim = leader(&file, &secret).await;
    let successor = if victim == 0 { 2 } else { 0 };
    let elections_before = candidacies(&dir);
    let pid = pid_of(&dir, &format!("node-{victim}"));
    let _resume = Resume(pid);
    // Past the soft timeout's ceiling (3 × 30 ms), well short of the hard floor (300 ms).
    assert!(proc::pause(pid, Duration::from_secs(5)), "node {victim} did not stop");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(proc::signal(pid, libc::SIGCONT));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ops = load.finish(vec![]).await;

    let log = node_log(&dir, successor);
    assert!(log.contains("soft timeout: proactive pull started"), "the successor never pulled ahead:\n{log}");
    assert!(log.contains("proactive pull aborted"), "the proactive pull was not aborted:\n{log}");
    assert_eq!(candidacies(&dir), elections_before, "a head stood for election after a short stop");
    assert_eq!(leader(&file, &secret).await, victim, "the leader changed");
    eprintln!("{ops} ops checked; node {victim} stopped 120 ms, the successor's pull started and aborted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_stopped_past_the_hard_timeout_is_replaced_and_answers_nothing_stale() {
    let (_t, dir) = disk_dir();
    let _up = start(&dir, &[]);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    let load = Load::start(&file, &secret);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let victim = leader(&file, &secret).await;
    let mut extra = Vec::new();
    // The value a stale read would show.
    let mut w = file.client(secret.clone());
    w.deadline = Duration::from_secs(20);
    let call_us = us(load.t0);
    w.put(b"stale-k", b"old").await.unwrap();
    extra.push(Op { client: 100, key: b"stale-k".to_vec(), call_us, ret_us: Some(us(load.t0)), kind: OpKind::Put(b"old".to_vec()) });

    let pid = pid_of(&dir, &format!("node-{victim}"));
    let _resume = Resume(pid);
    assert!(proc::pause(pid, Duration::from_secs(5)), "node {victim} did not stop");
    // A client of the other nodes (a put sent to the stopped one would stay unanswered, so
    // indeterminate) reaches the new leader once it is elected and serves.
    let others: BTreeMap<u32, std::net::SocketAddr> = file.nodes.iter().filter(|(i, _)| **i != victim).map(|(i, a)| (*i, *a)).collect();
    let mut w = WitnessClient::new(others, secret.clone());
    w.deadline = Duration::from_secs(20);
    let call_us = us(load.t0);
    w.put(b"stale-k", b"new").await.expect("no new leader took the put");
    extra.push(Op { client: 100, key: b"stale-k".to_vec(), call_us, ret_us: Some(us(load.t0)), kind: OpKind::Put(b"new".to_vec()) });
    let new_leader = w.leader_guess();
    assert_ne!(new_leader, victim, "the stopped node took the put");
    assert!(new_leader != 1, "the backup leads");
    assert!(proc::signal(pid, libc::SIGCONT));

    // The old primary, resumed, talked to alone (its redirections cannot be followed): no
    // read is answered, stale or not.
    let addr = file.nodes[&victim];
    let mut pinned = WitnessClient::new(BTreeMap::from([(victim, addr)]), secret.clone());
    pinned.deadline = Duration::from_millis(300);
    let until = Instant::now() + Duration::from_millis(1500);
    let mut refused = 0;
    while Instant::now() < until {
        let call_us = us(load.t0);
        match pinned.get(b"stale-k").await {
            Ok(v) => {
                let shown = v.as_deref().map(String::from_utf8_lossy);
                panic!("the deposed primary answered a read: {shown:?}");
            }
            Err(_) => refused += 1,
        }
        let _ = call_us;
    }
    assert!(refused >= 1);
    // Through the new leader: the new value.
    let call_us = us(load.t0);
    let got = w.get(b"stale-k").await.unwrap();
    assert_eq!(got.as_deref(), Some(&b"new"[..]));
    extra.push(Op { client: 100, key: b"stale-k".to_vec(), call_us, ret_us: Some(us(load.t0)), kind: OpKind::Get(got) });
    let ops = load.finish(extra).await;

    let log = node_log(&dir, new_leader);
    assert!(log.contains("Leader"), "node {new_leader} never logged its leadership:\n{log}");
    eprintln!("{ops} ops checked; node {new_leader} took over from the stopped node {victim}, which then refused {refused} reads");
}

#[test]
fn witness_node_refuses_a_leaderless_recovery_scheme() {
    let (_t, dir) = disk_dir();
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["kv", "node", "--protocol", "witness", "--role", "head", "--id", "0", "--recovery", "full-copy"])
        .args(["--peers", "0=127.0.0.1:1,1=127.0.0.1:2,2=127.0.0.1:3", "--data"])
        .arg(dir.join("n0"))
        .arg("--secret-file")
        .arg(&secret)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("leaderless-KV scheme"), "unexpected error: {err}");
}
