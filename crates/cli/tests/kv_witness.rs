//! The witness KV (CANDStore) as real processes: `understudy kv up --protocol witness` starts a
//! primary, a backup and a witness on loopback; `kv put`/`kv get` work through the CLI; under a
//! small write and read load the primary is killed with SIGKILL, a witness is elected, pulls
//! values from the backup and serves every acknowledged value; the whole recorded history
//! (every client's gets and puts, before, across and after the kill) is checked for
//! linearizability with `kv::checker`.

use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::checker::{self, Op, OpKind};
use kv::witness::driver::{WitnessClient, WitnessError};

mod witness_group;
use witness_group::*;

const CLIENTS: u64 = 4;
const KEYS_PER_CLIENT: u64 = 8;

/// One closed-loop client: puts unique values to its own keys (half the ops) and gets keys of
/// every client, recording each op with its call and return time (`ret_us: None` = no answer:
/// a put that may or may not have taken effect).
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

/// With proactive recovery (the default): the witness pulls the backup's log once it misses
/// the primary for the soft timeout, before it is elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn witness_takes_over_after_sigkill_of_the_primary_and_serves_every_acked_value() {
    failover(&[], Fault::KillPrimary { live_recovery: false }).await;
}

/// Without proactive pulls: the new leader holds keys only and must pull the values from the
/// backup after its election (PriorityPull on a Get miss, BatchPull in the background) while it
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn witness_serves_during_live_recovery_without_proactive_pulls() {
    failover(&["--soft-timeout-ms", "0"], Fault::KillPrimary { live_recovery: true }).await;
}

/// The N = 2 layout (primary, two backups, two witnesses): the designated successor (the
/// lowest-id witness, node 3) takes over and pulls from both backups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn witness_takes_over_in_the_two_backup_two_witness_layout() {
    failover(&["--backups", "2", "--witnesses", "2", "--soft-timeout-ms", "0"], Fault::KillPrimary { live_recovery: true }).await;
}

/// The offline baseline (`--recovery offline`): the same detection and election, then the new
/// primary serves nothing until its copy is done (clients retry `Unavailable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_recovery_baseline_serves_once_its_copy_is_done() {
    failover(&["--recovery", "offline"], Fault::KillPrimary { live_recovery: false }).await;
}

/// The backup killed with SIGKILL and started again on its files: it is rebuilt from its NVMM
/// buffer and SSD log (`WitnessCore::restore`), acks again, and puts (which need every voting
/// backup) commit again; nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_killed_and_restarted_on_its_tiers_rejoins() {
    failover(&[], Fault::RestartBackup).await;
}

enum Fault {
    KillPrimary { live_recovery: bool },
    RestartBackup,
}

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn failover(extra: &[&str], fault: Fault) {
    let (_t, dir) = disk_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let _up = start(&dir, extra);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    let backups = file.backups;
    assert_eq!(file.nodes.len() as u32, if extra.is_empty() { 3 } else { 1 + 2 * backups }, "primary + backups + witnesses");
    let cf = dir.join("kv-cluster.json");
    let cf = cf.to_str().unwrap();

    // The CLI's put and get go through the leader-following client.
    let o = cli(&["kv", "put", "hello", "world", "--cluster", cf]);
    assert!(o.status.success(), "kv put: {}", String::from_utf8_lossy(&o.stderr));
    let o = cli(&["kv", "get", "hello", "--cluster", cf]);
    assert!(o.status.success(), "kv get: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "world");
    let o = cli(&["kv", "get", "never-written", "--cluster", cf]);
    assert_eq!(o.status.code(), Some(1), "a missing key exits 1");

    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let hist = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(load(c, file.client(secret.clone()), t0, stop.clone(), hist.clone())))
        .collect();
    // Warm-up: enough acknowledged puts that the backup has written some back to its SSD log.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let acked_before = hist.lock().unwrap().iter().filter(|o| o.ret_us.is_some() && matches!(o.kind, OpKind::Put(_))).count();
    assert!(acked_before >= 20, "only {acked_before} puts acknowledged before the kill");

    // The serving leader (node 0 unless a loaded machine's stall already caused an election).
    let mut probe = file.client(secret.clone());
    probe.put(b"probe", b"p").await.unwrap();
    let old_leader = probe.leader_guess();
    let victim_id = if matches!(fault, Fault::KillPrimary { .. }) { old_leader } else { 1 };
    let victim = pid_of(&dir, &format!("node-{victim_id}"));
    // The victim's own command line, to start it again on its files.
    let cmdline = std::fs::read(format!("/proc/{victim}/cmdline")).unwrap();
    let args: Vec<String> = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).skip(1).map(|a| String::from_utf8(a.to_vec()).unwrap()).collect();
    let kill_us = t0.elapsed().as_micros() as u64;
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    // Declared after `_up`, so dropped (killed) before `kv up` removes the group's NVMM.
    let mut _restarted = None;
    if let Fault::RestartBackup = fault {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let log = std::fs::File::create(dir.join("logs/node-1.restarted.log")).unwrap();
        _restarted = Some(KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_understudy")).args(&args).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap(),
        ));
    }
    let restart_us = t0.elapsed().as_micros() as u64;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t).await.expect("a load client hung").unwrap();
    }

    // The load went on after the kill: the witness took over and committed new puts.
    let mut history = hist.lock().unwrap().clone();
    let acked_after = history.iter().filter(|o| matches!(o.kind, OpKind::Put(_)) && o.call_us > restart_us && o.ret_us.is_some()).count();
    assert!(acked_after >= 10, "only {acked_after} puts acknowledged after the kill of the primary");

    // Every key read through the new leader: the last acknowledged put or one still unknown.
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
        let got = cl.get(key).await.unwrap_or_else(|e| panic!("get {:?} after the failover: {e}", String::from_utf8_lossy(key)));
        // Values are unique: a put of the value read that never answered may have taken effect.
        let later_unknown = history.iter().any(|o| &o.key == key && o.ret_us.is_none() && matches!(&o.kind, OpKind::Put(v) if Some(v) == got.as_ref()));
        assert!(
            got.as_ref() == Some(want) || later_unknown,
            "key {:?}: read {:?}, the last acknowledged put wrote {:?}",
            String::from_utf8_lossy(key),
            got.as_ref().map(|v| String::from_utf8_lossy(v).into_owned()),
            String::from_utf8_lossy(want)
        );
        history.push(Op { client: 1000, key: key.clone(), call_us, ret_us: Some(t0.elapsed().as_micros() as u64), kind: OpKind::Get(got) });
    }
    let leader = cl.leader_guess();
    assert!(leader == 0 || leader > backups, "backup {leader} leads");
    if matches!(fault, Fault::KillPrimary { .. }) {
        assert_ne!(leader, victim_id, "the killed leader still leads");
    }
    if let Err(v) = checker::check(&history) {
        panic!("{v}");
    }
    let _ = kill_us;
    if let Fault::RestartBackup = fault {
        let log1 = std::fs::read_to_string(dir.join("logs/node-1.restarted.log")).unwrap();
        assert!(log1.contains("restoring from its tiers"), "the backup did not restore:\n{log1}");
        eprintln!("{} ops, {acked_before} puts acked before the kill, {acked_after} after the restart; {} keys checked", history.len(), last.len());
        return;
    }
    let log2 = std::fs::read_to_string(dir.join(format!("logs/node-{leader}.log"))).unwrap();
    assert!(log2.contains("Leader"), "the witness never logged its leadership:\n{log2}");
    let recovered = log2.lines().filter(|l| l.contains("recovered:")).last().unwrap_or_else(|| panic!("the witness never completed its recovery:\n{log2}"));
    if let Fault::KillPrimary { live_recovery: true } = fault {
        assert!(recovered.contains(" 0 proactively pulled"), "{recovered}");
        assert!(!recovered.contains(" 0 keys missing at start"), "nothing was left to pull after the election: {recovered}");
    }
    eprintln!(
        "{} ops, {acked_before} puts acked before the kill, {acked_after} after; {} keys checked; witness: {}",
        history.len(),
        last.len(),
        log2.lines().filter(|l| l.contains("recovered") || l.contains("Leader")).collect::<Vec<_>>().join(" | ")
    );
}

#[test]
fn witness_node_refuses_a_role_that_contradicts_the_layout() {
    let (_t, dir) = disk_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef\n").unwrap();
    let o = cli(&[
        "kv", "node", "--protocol", "witness", "--role", "head", "--id", "1",
        "--peers", "0=127.0.0.1:1,1=127.0.0.1:2,2=127.0.0.1:3",
        "--data", dir.join("n1").to_str().unwrap(), "--secret-file", secret.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("node 1 is a Backup"), "unexpected error: {err}");
}

/// Malformed and oversized requests get an error or a closed connection, never a crash: the
/// group keeps serving and no node exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn witness_nodes_survive_malformed_and_oversized_requests() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use kv::witness::driver::{Hello, NetMsg};
    let (_t, dir) = disk_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let _up = start(&dir, &[]);
    let (file, secret) = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || wait_ready(&dir)
    })
    .await
    .unwrap();
    let pids: Vec<u32> = (0..3).map(|i| pid_of(&dir, &format!("node-{i}"))).collect();
    let closed = |mut s: tokio::net::TcpStream| async move {
        let mut b = [0u8; 64];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue, // the auth challenge, before the node gives up
                Err(_) => return false,
            }
        }
    };
    for addr in file.nodes.values() {
        // No authentication, just bytes.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&[0xAB; 4096]).await.unwrap();
        assert!(closed(s).await, "{addr}: unauthenticated garbage left the connection open");
        // Authenticated, then a well-framed message that is no NetMsg.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        wire::auth::connect(&mut s, &secret).await.unwrap();
        wire::write_msg(&mut s, &NetMsg::Hello(Hello::Client)).await.unwrap();
        s.write_all(&wire::encode_frame(&vec![0xFFu8; 100]).unwrap()).await.unwrap();
        assert!(closed(s).await, "{addr}: a malformed frame left the connection open");
        // Authenticated, then a frame header announcing 1 GiB.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        wire::auth::connect(&mut s, &secret).await.unwrap();
        wire::write_msg(&mut s, &NetMsg::Hello(Hello::Client)).await.unwrap();
        let mut header = [0u8; wire::FRAME_HEADER_BYTES];
        header[..4].copy_from_slice(&(1u32 << 30).to_le_bytes());
        s.write_all(&header).await.unwrap();
        assert!(closed(s).await, "{addr}: an oversized frame left the connection open");
    }
    // A value above the limit, in a frame the node accepts: a clear refusal.
    let mut cl = file.client(secret.clone());
    let big = vec![7u8; kv::witness::proto::MAX_VALUE_BYTES + 1];
    match cl.put(b"big", &big).await {
        Err(WitnessError::Refused(why)) => assert!(why.contains("bytes"), "{why}"),
        r => panic!("an oversized value was not refused: {r:?}"),
    }
    cl.put(b"after", b"fine").await.unwrap();
    assert_eq!(cl.get(b"after").await.unwrap().as_deref(), Some(&b"fine"[..]));
    for p in pids {
        // SAFETY: kill(2) with signal 0 only checks that the process exists.
        assert_eq!(unsafe { libc::kill(p as i32, 0) }, 0, "node pid {p} is gone");
    }
}
