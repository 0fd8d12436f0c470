//! Fault tolerance that comes back by itself, with real processes: `kv up --protocol witness
//! --spares 1` starts a spare witness; the witness is killed with SIGKILL under a client load
//! and the leader, on its own, adds the spare, lets it catch up, removes the lost witness and
//! promotes the spare (seen in every node's membership view); then the primary is killed too
//! and the spare, now the only head left, is elected and serves every acknowledged write.
//! And `kv reconfig`: an operator's change commits, a refused one exits non-zero with why.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::checker::{self, Op, OpKind};
use kv::witness::core::config::Config;
use kv::witness::driver::{WitnessClient, WitnessError};
use testbed::kv_witness::WitnessClusterFile;

mod witness_group;
use witness_group::*;

fn kill9(dir: &Path, node: u32) {
    let pid = pid_of(dir, &format!("node-{node}"));
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

const CLIENTS: u64 = 3;
const KEYS_PER_CLIENT: u64 = 8;

/// One closed-loop client: puts unique values to its own keys (half the ops) and gets keys of
/// every client, recording each op (`ret_us: None`: a put that may or may not have happened).
async fn load(c: u64, mut cl: WitnessClient, t0: Instant, stop: Arc<AtomicBool>, hist: Arc<Mutex<Vec<Op>>>) {
    let us = |t0: Instant| t0.elapsed().as_micros() as u64;
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
                    continue; // an unanswered get constrains nothing
                }
            }
        };
        hist.lock().unwrap().push(op);
    }
}

/// Every live node's view, until `done` holds for all of them (or the deadline).
async fn wait_views(
    file: &WitnessClusterFile,
    secret: &[u8],
    live: &[u32],
    within: Duration,
    what: &str,
    done: impl Fn(&Config) -> bool,
) -> BTreeMap<u32, Config> {
    let deadline = Instant::now() + within;
    let mut cl = file.client(secret.to_vec());
    loop {
        let mut views = BTreeMap::new();
        for &n in live {
            if let Ok((c, _, _)) = cl.membership(n).await {
                views.insert(n, c);
            }
        }
        if views.len() == live.len() && views.values().all(&done) {
            return views;
        }
        assert!(Instant::now() < deadline, "{what} within {within:?}; the nodes' views: {views:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_replaces_a_killed_witness_by_itself_and_the_primary_kill_is_then_survived() {
    let (_t, dir) = disk_dir();
    let _up = start(&dir, &["--spares", "1"]);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    assert_eq!(file.nodes.len(), 4, "primary, backup, witness and the spare witness");
    let up_out = std::fs::read_to_string(dir.with_extension("up.out")).unwrap();
    assert!(up_out.contains("spare witness"), "{up_out}");

    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let hist = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(load(c, file.client(secret.clone()), t0, stop.clone(), hist.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut probe = file.client(secret.clone());
    probe.put(b"probe", b"p").await.unwrap();
    let leader = probe.leader_guess();
    // The witness is whichever head does not lead (node 2 unless a stall moved leadership).
    let witness = if leader == 0 { 2 } else { 0 };
    assert!(leader == 0 || leader == 2, "node {leader} leads");
    kill9(&dir, witness);

    // No operator: the leader adds spare 3, it catches up, the lost witness goes and 3 votes.
    let live = [leader, 1, 3];
    wait_views(&file, &secret, &live, Duration::from_secs(30), "spare 3 replaced the killed witness", |c| {
        c.member(witness).is_none() && c.member(3).is_some_and(|m| m.voting)
    })
    .await;
    let acked = |h: &Vec<Op>, from_us: u64| h.iter().filter(|o| matches!(o.kind, OpKind::Put(_)) && o.call_us > from_us && o.ret_us.is_some()).count();
    let replaced_us = t0.elapsed().as_micros() as u64;
    // The operator's view (`kv reconfig show`) says the same.
    let cf = dir.join("kv-cluster.json");
    let o = cli(&["kv", "reconfig", "show", "--cluster", cf.to_str().unwrap()]);
    let shown = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "kv reconfig show: {}", String::from_utf8_lossy(&o.stderr));
    assert!(shown.contains("3 head voting") && shown.contains(&format!("node {witness}: no answer")), "{shown}");

    // The second failure: the primary. Only the spare is left to lead, from backup 1's values.
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill9(&dir, leader);
    let killed_us = t0.elapsed().as_micros() as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked(&hist.lock().unwrap(), killed_us) < 10 {
        assert!(Instant::now() < deadline, "no puts acknowledged after the primary's kill");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t).await.expect("a load client hung").unwrap();
    }

    // Every key read through the new leader: the last acknowledged put or one still unknown.
    let mut history = hist.lock().unwrap().clone();
    let mut last: BTreeMap<Vec<u8>, (u64, Vec<u8>)> = BTreeMap::new();
    for o in &history {
        if let (OpKind::Put(v), Some(r)) = (&o.kind, o.ret_us) {
            if last.get(&o.key).is_none_or(|(t, _)| *t < r) {
                last.insert(o.key.clone(), (r, v.clone()));
            }
        }
    }
    let mut cl = file.client(secret.clone());
    for (key, (_, want)) in &last {
        let call_us = t0.elapsed().as_micros() as u64;
        let got = cl.get(key).await.unwrap_or_else(|e| panic!("get {:?} after both failures: {e}", String::from_utf8_lossy(key)));
        let unknown = history.iter().any(|o| &o.key == key && o.ret_us.is_none() && matches!(&o.kind, OpKind::Put(v) if Some(v) == got.as_ref()));
        assert!(
            got.as_ref() == Some(want) || unknown,
            "key {:?}: read {:?}, the last acknowledged put wrote {:?}",
            String::from_utf8_lossy(key),
            got.as_ref().map(|v| String::from_utf8_lossy(v).into_owned()),
            String::from_utf8_lossy(want)
        );
        history.push(Op { client: 1000, key: key.clone(), call_us, ret_us: Some(t0.elapsed().as_micros() as u64), kind: OpKind::Get(got) });
    }
    assert_eq!(cl.leader_guess(), 3, "the spare leads after the primary's kill");
    if let Err(v) = checker::check(&history) {
        panic!("{v}");
    }
    eprintln!(
        "{} ops, {} keys checked; puts acked after the replacement {}, after the primary's kill {}",
        history.len(),
        last.len(),
        acked(&history, replaced_us),
        acked(&history, killed_us)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_reconfig_commits_a_change_and_a_refused_one_exits_with_why() {
    let (_t, dir) = disk_dir();
    let _up = start(&dir, &["--spares", "1"]);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    let cf = dir.join("kv-cluster.json");
    let cf = cf.to_str().unwrap();
    let run = |args: &[&str]| {
        let mut v = vec!["kv", "reconfig"];
        v.extend_from_slice(args);
        v.extend_from_slice(&["--cluster", cf]);
        let o = cli(&v);
        (o.status.success(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    // The spare joins non-voting; the change is answered once committed.
    let (ok, out, err) = run(&["add", "3", "--kind", "head"]);
    assert!(ok, "add: {err}");
    assert!(out.contains("committed: epoch 2") && out.contains("3 head non-voting"), "{out}");
    // Voting would make the commit quorum (leader + backup) a minority of four voters.
    let (ok, _, err) = run(&["promote", "3"]);
    assert!(!ok && err.contains("refused") && err.contains("majority"), "promote: {err}");
    let mut probe = file.client(secret.clone());
    probe.put(b"probe", b"p").await.unwrap();
    let leader = probe.leader_guess().to_string();
    let (ok, _, err) = run(&["remove", &leader]);
    assert!(!ok && err.contains("cannot remove"), "remove the leader: {err}");
    let (ok, _, err) = run(&["add"]);
    assert!(!ok && err.contains("needs the node's ID"), "add without an id: {err}");
    let (ok, out, err) = run(&["show"]);
    assert!(ok, "show: {err}");
    assert_eq!(out.lines().filter(|l| l.contains("epoch 2:") && l.contains("3 head non-voting")).count(), 4, "{out}");
    let (ok, out, err) = run(&["remove", "3"]);
    assert!(ok && out.contains("committed: epoch 3"), "remove 3: {out} {err}");
    // A leaderless group's file is not a witness group's.
    let other = dir.with_extension("other.json");
    std::fs::write(&other, r#"{"nodes":{},"secret_file":"/nonexistent"}"#).unwrap();
    let o = cli(&["kv", "reconfig", "show", "--cluster", other.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("leaderless group"), "{err}");
}
