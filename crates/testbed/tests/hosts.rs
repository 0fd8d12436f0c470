//! The multi-host test bed ([`testbed::hosts`]): hosts reach each other and nothing else, a
//! partition cuts one off, a killed host keeps no process, parallel beds stay apart, a killed
//! test run's beds are swept; and a real 3-member etcd cluster, one member per host, that loses
//! its leader's host and has a member partitioned away. Root only (skipped otherwise).

use std::io::BufRead;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testbed::etcd::{EtcdCluster, MemberPlace};
use testbed::hosts::{self, HostState, Hosts};
use testbed::proc;

fn skip() -> bool {
    if let Err(e) = hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return true;
    }
    false
}

/// A listener on host `i` (nothing accepts: the kernel completes the handshake all the same).
fn listen(bed: &Hosts, i: usize) -> (TcpListener, SocketAddr) {
    let addr = bed.addr(i);
    let l = bed.host(i).run_in(move || TcpListener::bind((addr, 0))).unwrap().unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Whether a TCP connection from host `from` to `to` is made within a second.
fn reaches(bed: &Hosts, from: usize, to: SocketAddr) -> bool {
    bed.host(from).run_in(move || TcpStream::connect_timeout(&to, Duration::from_secs(1)).is_ok()).unwrap()
}

/// Polls `f` until it holds, at most `bound`.
fn eventually(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn bed_namespaces(bed_name: &str) -> Vec<String> {
    failover::netns::list().unwrap().into_iter().filter(|n| n.starts_with(&format!("{bed_name}-"))).collect()
}

#[test]
fn hosts_reach_each_other_and_a_partitioned_host_is_cut_off() {
    if skip() {
        return;
    }
    let bed = Hosts::create(3).unwrap();
    let name = bed.name().to_string();
    let listeners: Vec<_> = (0..3).map(|i| listen(&bed, i)).collect();
    for from in 0..3 {
        for (_, to) in &listeners {
            assert!(reaches(&bed, from, *to), "host {from} reaches {to}");
        }
    }
    // The root namespace is not disturbed: it holds no address of the bed.
    let root = Command::new("ip").args(["-o", "-4", "addr", "show"]).output().unwrap();
    let net = bed.subnet().to_string();
    let prefix = net.trim_end_matches('0');
    assert!(!String::from_utf8_lossy(&root.stdout).contains(&format!(" {prefix}")), "the root namespace has an address in {net}/24");

    let sleeper = bed.host(1).spawn(bed.host(1).command("sleep").arg("1000")).unwrap();
    bed.partition(1).unwrap();
    assert_eq!(bed.host(1).state(), HostState::Partitioned);
    assert!(!reaches(&bed, 0, listeners[1].1), "0 reaches partitioned 1");
    assert!(!reaches(&bed, 2, listeners[1].1), "2 reaches partitioned 1");
    assert!(!reaches(&bed, 1, listeners[0].1), "partitioned 1 reaches 0");
    assert!(reaches(&bed, 0, listeners[2].1), "the others still reach each other");
    assert!(reaches(&bed, 1, listeners[1].1), "a partitioned host still reaches itself");
    assert!(proc::alive(sleeper) && bed.host(1).pids() == vec![sleeper], "a partition kills nothing");

    bed.heal(1).unwrap();
    assert_eq!(bed.host(1).state(), HostState::Up);
    assert!(eventually(Duration::from_secs(5), || reaches(&bed, 0, listeners[1].1)), "a healed host is reachable again");
    assert!(reaches(&bed, 1, listeners[2].1));

    drop(listeners);
    drop(bed);
    assert!(!proc::alive(sleeper), "dropping the bed kills its processes");
    assert_eq!(bed_namespaces(&name), Vec::<String>::new(), "dropping the bed deletes its namespaces");
}

#[test]
fn kill_host_leaves_no_process_alive_in_its_namespace() {
    if skip() {
        return;
    }
    let bed = Hosts::create(2).unwrap();
    let (h0, h1) = (bed.host(0), bed.host(1));
    let other = h0.spawn(h0.command("sleep").arg("1000")).unwrap();
    // A tracked child, a child the caller owns with children of its own, and a daemon that
    // left its parent (reparented away from us): all are the host's.
    h1.spawn(h1.command("sleep").arg("1000")).unwrap();
    let mut owned = h1.command("sh").args(["-c", "sleep 1000 & sleep 1000 & wait"]).spawn().unwrap();
    let status = h1.command("setsid").args(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"]).status().unwrap();
    assert!(status.success());
    assert!(eventually(Duration::from_secs(10), || h1.pids().len() >= 5), "host 1 runs {:?}", h1.pids());
    let before = h1.pids();
    let (_l, to1) = listen(&bed, 1);
    assert!(reaches(&bed, 0, to1));

    let killed = bed.kill_host(1).unwrap();
    assert_eq!(h1.state(), HostState::Down);
    assert_eq!(h1.pids(), Vec::<u32>::new(), "no process is left on a killed host");
    for p in &before {
        assert!(killed.contains(p) && !proc::alive(*p), "process {p} of the killed host survived");
    }
    let _ = owned.wait();
    assert!(proc::alive(other) && h0.pids() == vec![other], "the other host is untouched");
    assert!(!reaches(&bed, 0, to1), "a killed host's link is down");
    assert!(bed.heal(1).is_err(), "a killed host comes back by a restart only");

    bed.restart_host(1).unwrap();
    assert_eq!(h1.state(), HostState::Up);
    assert_eq!(h1.pids(), Vec::<u32>::new(), "a restarted host starts empty");
    // The old listener's socket lived in the old namespace: a fresh one on the same address.
    let (_l, to1) = listen(&bed, 1);
    assert!(eventually(Duration::from_secs(5), || reaches(&bed, 0, to1)), "a restarted host is reachable");
    let later = h1.spawn(h1.command("sleep").arg("1000")).unwrap();
    assert_eq!(h1.pids(), vec![later], "a command made after the restart runs in the new namespace");
}

#[test]
fn parallel_beds_do_not_collide() {
    if skip() {
        return;
    }
    let beds: Vec<Hosts> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3).map(|_| s.spawn(|| Hosts::create(2).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, x) in beds.iter().enumerate() {
        for y in &beds[a + 1..] {
            assert_ne!(x.name(), y.name());
            assert_ne!(x.subnet(), y.subnet(), "two live beds share a /24");
        }
        let (_l, to) = listen(x, 1);
        assert!(reaches(x, 0, to), "bed {} works", x.name());
        // Another bed's host is not reachable: separate switches, separate networks.
        let (_l, other) = listen(&beds[(a + 1) % beds.len()], 1);
        assert!(!reaches(x, 0, other), "bed {} reaches another bed's host", x.name());
    }
    let names: Vec<String> = beds.iter().map(|b| b.name().to_string()).collect();
    drop(beds);
    for n in names {
        assert_eq!(bed_namespaces(&n), Vec::<String>::new());
    }
}

const ROLE_ENV: &str = "UNDERSTUDY_HOSTS_TEST_ROLE";
/// How long the child test run may take to make its bed.
const CHILD_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A test run that is SIGKILLed leaves its bed (namespaces, processes); the next bed made
/// anywhere sweeps it. The "killed run" is this very test, run again as a child process.
#[test]
fn beds_of_a_killed_test_run_are_swept() {
    if skip() {
        return;
    }
    if std::env::var(ROLE_ENV).as_deref() == Ok("child") {
        let bed = Hosts::create(2).unwrap();
        // A plain command: no parent-death signal, so it outlives this run as a daemon would.
        let sleeper = bed.host(1).spawn(bed.host(1).command("sleep").arg("1000")).unwrap();
        // On a line of its own: libtest has printed "test NAME ... " without a newline.
        println!("\nready {} {sleeper}", bed.name());
        std::io::Write::flush(&mut std::io::stdout()).unwrap();
        std::thread::sleep(Duration::from_secs(600));
        panic!("the child test run was not killed");
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "beds_of_a_killed_test_run_are_swept", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "child")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(r) = l.strip_prefix("ready ") {
                let _ = tx.send(r.to_string());
            }
        }
    });
    let ready = rx.recv_timeout(CHILD_READY_TIMEOUT);
    proc::signal(child.id(), libc::SIGKILL);
    let _ = child.wait();
    let ready = ready.expect("the child test run made its bed");
    let (old, sleeper) = ready.split_once(' ').unwrap();
    let sleeper: u32 = sleeper.parse().unwrap();
    // Another test's new bed may already have swept it; if not, it is all still there.
    if !bed_namespaces(old).is_empty() {
        assert!(proc::alive(sleeper), "the killed run's process outlived it");
    }
    let bed = Hosts::create(1).unwrap();
    assert_eq!(bed_namespaces(old), Vec::<String>::new(), "a new bed sweeps the killed run's namespaces");
    assert!(proc::wait_gone(&[sleeper], Duration::from_secs(5)), "the sweep killed the killed run's process {sleeper}");
    assert!(!bed_namespaces(bed.name()).is_empty(), "a live bed is never swept");
    assert!(hosts::sweep_stale().unwrap().iter().all(|n| !n.starts_with(bed.name())));
}

// ---- a real etcd cluster, one member per host ----

/// Bounds for what takes about one election timeout (0.5 s) on an idle machine.
const ELECTION_BOUND: Duration = Duration::from_secs(20);
const START_BOUND: Duration = Duration::from_secs(30);

fn wait_leader(etcd: &EtcdCluster, on: usize, members: &[usize], bound: Duration, what: &str) -> (usize, Duration) {
    let t0 = Instant::now();
    let mut found = None;
    assert!(eventually(bound, || { found = etcd.leader(on, members); found.is_some() }), "{what}: no leader among {members:?} within {bound:?}");
    (found.unwrap(), t0.elapsed())
}

/// A 3-member etcd cluster, one member per host on the host's address: the leader's host is
/// killed and the other two elect a leader and serve a put and a get; the host comes back with
/// its disk and rejoins; the (new) leader's host is partitioned away: writes through the other
/// two succeed, the partitioned member refuses a linearizable read; healed, it catches up and
/// one leader is left.
#[test]
fn etcd_cluster_survives_the_loss_of_its_leaders_host_and_a_partition() {
    if skip() {
        return;
    }
    let bed = Hosts::create(3).unwrap();
    let all = [0, 1, 2];
    // Member i on host i, at the host's address.
    let mut etcd = EtcdCluster::start_with(bed.hosts().iter().map(MemberPlace::from).collect()).unwrap();
    let mut members: Vec<u32> = all.iter().map(|i| etcd.pid(*i).unwrap()).collect();
    let (dead, t) = wait_leader(&etcd, 0, &all, START_BOUND, "start");
    eprintln!("cluster up, leader on host {dead} after {t:?}");
    etcd.etcdctl(0, &all, &["put", "k1", "v1"]).unwrap();

    // The leader's machine is lost.
    bed.kill_host(dead).unwrap();
    let rest: Vec<usize> = all.iter().copied().filter(|j| *j != dead).collect();
    let on = rest[0];
    let t0 = Instant::now();
    let (new, _) = wait_leader(&etcd, on, &rest, ELECTION_BOUND, "after the leader's host died");
    assert_ne!(new, dead);
    assert!(eventually(ELECTION_BOUND, || etcd.etcdctl(on, &rest, &["put", "k2", "v2"]).is_ok()), "no put served after the leader's host died");
    let got = etcd.etcdctl(on, &rest, &["get", "k2", "--print-value-only"]).unwrap();
    assert_eq!(got.trim(), "v2");
    assert_eq!(etcd.etcdctl(on, &rest, &["get", "k1", "--print-value-only"]).unwrap().trim(), "v1", "an acknowledged write survived");
    eprintln!("leader host {dead} killed: new leader on {new}, put+get served {:?} after the kill", t0.elapsed());

    // The machine reboots with its disk: the member restarts from its data directory.
    bed.restart_host(dead).unwrap();
    etcd.restart(dead).unwrap();
    members.push(etcd.pid(dead).unwrap());
    let (p, _) = wait_leader(&etcd, on, &all, START_BOUND, "after the restart");
    assert!(
        eventually(START_BOUND, || etcd.etcdctl(dead, &[dead], &["get", "k2", "--print-value-only", "--consistency=s"]).is_ok_and(|v| v.trim() == "v2")),
        "the restarted member did not catch up"
    );

    // The leader's host is partitioned away.
    bed.partition(p).unwrap();
    let rest: Vec<usize> = all.iter().copied().filter(|j| *j != p).collect();
    let on = rest[0];
    let t0 = Instant::now();
    assert!(eventually(ELECTION_BOUND, || etcd.etcdctl(on, &rest, &["put", "k3", "v3"]).is_ok()), "no put served through the majority side");
    eprintln!("leader host {p} partitioned: put served {:?} after the cut", t0.elapsed());
    let r = etcd.etcdctl(p, &[p], &["get", "k3"]);
    assert!(r.is_err(), "the partitioned member served a linearizable read: {r:?}");
    let stale = etcd.etcdctl(p, &[p], &["get", "k3", "--print-value-only", "--consistency=s"]).unwrap();
    assert_eq!(stale.trim(), "", "the partitioned member has a write made after the cut");
    let (l, _) = wait_leader(&etcd, on, &rest, ELECTION_BOUND, "majority side");
    assert_ne!(l, p);

    // Healed: it catches up, reads linearizably again, and one leader is left.
    bed.heal(p).unwrap();
    let t0 = Instant::now();
    assert!(
        eventually(ELECTION_BOUND, || etcd.etcdctl(p, &[p], &["get", "k3", "--print-value-only"]).is_ok_and(|v| v.trim() == "v3")),
        "the healed member did not catch up"
    );
    eprintln!("healed host {p} caught up {:?} after the heal", t0.elapsed());
    wait_leader(&etcd, p, &all, ELECTION_BOUND, "after the heal");
    let name = bed.name().to_string();
    drop(bed);
    assert_eq!(bed_namespaces(&name), Vec::<String>::new());
    assert!(members.iter().all(|p| !proc::alive(*p)), "an etcd member outlived its bed");
}
