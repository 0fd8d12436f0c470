//! The store's API on a real 3-member etcd cluster (Debian's etcd-server), started by each test
//! and stopped by PID; and what only etcd has: member loss, quorum loss, several processes.
//!
//! The tests run one at a time ([`serial`]): each starts three etcd members with a 500 ms
//! election timeout, and five such clusters at once on a loaded 2-core machine would miss
//! heartbeats and re-elect for no reason of the test's.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use control::{Error, Store};
use testbed::etcd::EtcdCluster;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

fn start(n: usize) -> EtcdCluster {
    tokio::task::block_in_place(|| EtcdCluster::start(n)).expect("etcd cluster starts")
}

async fn open(cluster: &EtcdCluster, id: &str) -> Store {
    Store::open(&cluster.url(), "test", id).await.expect("store opens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_txn_guards() {
    let _s = serial().await;
    let cluster = start(3);
    common::txn_guards(&open(&cluster, "id-1").await).await;
}

/// Two clients (two store handles, as two processes would have) campaign; one leads; when it
/// stops renewing, the other takes over within the bound and the old one's writes are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_election_takeover() {
    let _s = serial().await;
    let cluster = start(3);
    let first = open(&cluster, "id-1").await;
    // The second client talks to another member first: the election holds across members.
    let second = Store::open(&format!("etcd://{},{}", cluster.endpoint(1), cluster.endpoint(2)), "test", "id-1").await.unwrap();
    common::election_takeover(&first, &second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_liveness() {
    let _s = serial().await;
    let cluster = start(3);
    common::liveness(&open(&cluster, "id-1").await).await;
}

/// Env var that turns [`etcd_killed_leader_process_is_replaced`] into its child: a process that
/// campaigns on the store at this address, says LEADER on stdout, and waits to be killed.
const CHILD_STORE: &str = "CONTROL_TEST_CHILD_STORE";

/// A leader in another process is SIGKILLed: the standby (this process) takes over within the
/// bound, and the dead leader's key is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_leader_process_is_replaced() {
    if let Ok(url) = std::env::var(CHILD_STORE) {
        let store = Store::open(&url, "test", "id-1").await.unwrap();
        let _leader = store.campaign("controller", "child", common::TTL).await.unwrap();
        println!("LEADER");
        tokio::time::sleep(Duration::from_secs(120)).await;
        panic!("the child leader was not killed");
    }
    let _s = serial().await;
    let cluster = start(3);
    let store = open(&cluster, "id-1").await;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["etcd_killed_leader_process_is_replaced", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_STORE, cluster.url())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = testbed::proc::KillOnDrop(cmd.spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints the test's name first, on the same line.
            if line.ends_with("LEADER") {
                let _ = tx.send(());
            }
        }
    });
    tokio::task::block_in_place(|| rx.recv_timeout(Duration::from_secs(30))).expect("the child became leader");
    assert_eq!(store.observe("controller").await.unwrap().as_deref(), Some("child"));

    let s = store.clone();
    let mut standby = tokio::spawn(async move { s.campaign("controller", "parent", common::TTL).await });
    assert!(tokio::time::timeout(common::TTL + common::TTL / 2, &mut standby).await.is_err(), "two leaders: the standby led while the child lived");
    let killed = Instant::now();
    assert!(testbed::proc::signal(child.0.id(), libc::SIGKILL));
    let _ = child.0.wait();
    let leader = tokio::time::timeout(common::TAKEOVER_BOUND, standby).await.expect("the standby took over within the bound").unwrap().unwrap();
    eprintln!("takeover after SIGKILL of the leader's process: {} ms (TTL {} ms)", killed.elapsed().as_millis(), common::TTL.as_millis());
    assert!(leader.is_leader());
    assert_eq!(store.observe("controller").await.unwrap().as_deref(), Some("parent"));
    leader.put(&store.key("nearlog", "file", "f1"), b"peers=1,2,3".to_vec()).await.unwrap();
}

/// The lease TTL of a leader that must survive an etcd leader's death: etcd needs its election
/// timeout and then some to elect another, during which no lease can be renewed.
const LONG_TTL: Duration = Duration::from_secs(5);

/// One member killed (a minority, perhaps etcd's leader): reads go on at once through the others,
/// including from a client whose first endpoint is the dead member; a write in flight while etcd
/// elects a new leader may come back Uncertain (etcd drops proposals sent to a dead leader), and
/// a retry succeeds within the bound; a leader with a long enough TTL keeps its leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_member_loss_is_survived() {
    let _s = serial().await;
    let mut cluster = start(3);
    let store = open(&cluster, "id-1").await;
    let k = store.key("volume", "vol", "v1");
    store.put(&k, b"before".to_vec()).await.unwrap();
    let leader = store.campaign("meta", "a", LONG_TTL).await.unwrap();
    cluster.kill(0);
    let t = Instant::now();
    assert_eq!(store.get(&k).await.expect("a read with one member of three dead").unwrap().value, b"before");
    eprintln!("first read after member 0 died: {} ms", t.elapsed().as_millis());
    let t = Instant::now();
    let mut uncertain = 0;
    loop {
        match store.put(&k, b"after".to_vec()).await {
            Ok(_) => break,
            Err(Error::Uncertain { .. }) | Err(Error::Unavailable { .. }) if t.elapsed() < Duration::from_secs(20) => uncertain += 1,
            Err(e) => panic!("no write within 20 s of a minority's loss: {e}"),
        }
    }
    eprintln!("first write after member 0 died: {} ms, {uncertain} uncertain attempts", t.elapsed().as_millis());
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, b"after");
    // Leadership survives: its renewals go to the live members.
    tokio::time::sleep(LONG_TTL).await;
    assert!(leader.is_leader(), "the leader lost its lease with a quorum up");
    leader.put(&k, b"leader".to_vec()).await.unwrap();
    tokio::task::block_in_place(|| cluster.restart(0)).unwrap();
    let only_first = Store::open(&format!("etcd://{}", cluster.endpoint(0)), "test", "id-1").await.unwrap();
    assert_eq!(only_first.get(&k).await.unwrap().unwrap().value, b"leader");
}

/// Quorum lost (two of three members killed): operations fail with a clear error within a
/// bound, leaders lose leadership, and everything works again once a quorum is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_quorum_loss_fails_clearly_and_recovers() {
    let _s = serial().await;
    let mut cluster = start(3);
    let store = open(&cluster, "id-1").await;
    let k = store.key("kv", "config", "cfg");
    store.put(&k, b"epoch-1".to_vec()).await.unwrap();
    let leader = store.campaign("kv-cm", "cm-a", common::TTL).await.unwrap();
    cluster.kill(1);
    cluster.kill(2);

    /// The failure mode is hanging forever; etcd's own timeouts and ours add up to about 10 s.
    const FAIL_BOUND: Duration = Duration::from_secs(20);
    let t = Instant::now();
    let e = tokio::time::timeout(FAIL_BOUND, store.get(&k)).await.expect("a read fails within the bound").unwrap_err();
    eprintln!("read without quorum failed after {} ms: {e}", t.elapsed().as_millis());
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    let t = Instant::now();
    let e = tokio::time::timeout(FAIL_BOUND, store.put(&k, b"epoch-2".to_vec())).await.expect("a write fails within the bound").unwrap_err();
    eprintln!("write without quorum failed after {} ms: {e}", t.elapsed().as_millis());
    assert!(matches!(e, Error::Unavailable { .. } | Error::Uncertain { .. }), "{e}");
    // The leader cannot renew: it learns it is no longer leader (self-fencing) within the TTL
    // plus a renewal's timeout.
    let why = tokio::time::timeout(FAIL_BOUND, leader.lost()).await.expect("the leader noticed");
    assert!(!leader.is_leader(), "{why}");
    assert!(matches!(leader.put(&k, b"x".to_vec()).await.unwrap_err(), Error::Deposed { .. } | Error::Unavailable { .. }));

    tokio::task::block_in_place(|| cluster.restart(1)).unwrap();
    let t = Instant::now();
    let mut last = None;
    while t.elapsed() < FAIL_BOUND {
        match store.put(&k, b"epoch-3".to_vec()).await {
            Ok(_) => {
                last = None;
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    assert!(last.is_none(), "no write within {FAIL_BOUND:?} of quorum's return: {last:?}");
    eprintln!("writes work again {} ms after quorum returned", t.elapsed().as_millis());
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, b"epoch-3");
    let again = tokio::time::timeout(common::TAKEOVER_BOUND * 2, store.campaign("kv-cm", "cm-b", common::TTL)).await.expect("a new leader after quorum returned").unwrap();
    assert!(again.is_leader());
}

/// A store holding another cluster's id is refused, naming both; the first cluster's keys stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_refuses_another_clusters_store() {
    let _s = serial().await;
    let cluster = start(3);
    let a = open(&cluster, "cluster-A").await;
    a.put(&a.key("volume", "vol", "v"), b"A's".to_vec()).await.unwrap();
    let e = Store::open(&cluster.url(), "test", "cluster-B").await.err().expect("another cluster's store refused");
    assert!(matches!(e, Error::ForeignCluster { .. }), "{e}");
    assert!(e.to_string().contains("cluster-A") && e.to_string().contains("cluster-B"), "{e}");
    assert_eq!(a.get(&a.key("volume", "vol", "v")).await.unwrap().unwrap().value, b"A's");
}

/// No etcd at the address: a clear error within a bound (not a hang, not an empty store).
#[tokio::test]
async fn etcd_unreachable_at_start_is_a_clear_error() {
    let ports = wire::ports::free_loopback_ports(2).unwrap();
    let url = format!("etcd://127.0.0.1:{},127.0.0.1:{}", ports[0], ports[1]);
    let t = Instant::now();
    let e = Store::open(&url, "test", "id").await.err().expect("unreachable etcd refused");
    assert!(t.elapsed() < control::OPEN_TIMEOUT + Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains(&ports[0].to_string()), "{e}");
    assert!(matches!(Store::open("etcd://", "test", "id").await.err().unwrap(), Error::BadUrl(_)));
}
