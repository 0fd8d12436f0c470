//! A flood of plain TCP connections (no secret) against every listening port of every daemon,
//! past the daemon's file descriptor limit: every daemon stays alive, keeps listening, and
//! serves a good client afterwards; an idle connection that never authenticates is closed
//! within the authentication deadline; a kv node does not spin while out of descriptors.
//!
//! Each daemon's RLIMIT_NOFILE is lowered after it started (prlimit(2) on its pid) to
//! [`FD_LIMIT`], and [`FLOOD_CONNECTIONS`] connections are held open against each of its
//! ports for [`HOLD`], then closed.

mod common;
#[path = "nearlog_common/mod.rs"]
mod nearlog_common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use testbed::proc::alive;

/// Descriptor limit given to every daemon (the usual default is 1024; lower keeps it quick).
const FD_LIMIT: u64 = 256;
/// Connections opened against each port: past the limit.
const FLOOD_CONNECTIONS: usize = 320;
/// How long the flood is held open.
const HOLD: Duration = Duration::from_millis(1500);
/// An unauthenticated idle connection must be closed by then (the deadline is 5 s, 10 s for NBD; generous
/// for a loaded machine, far below "never").
const IDLE_CLOSE_BOUND: Duration = Duration::from_secs(16);

fn set_fd_limit(pid: u32, n: u64) {
    let lim = libc::rlimit { rlim_cur: n, rlim_max: n };
    // SAFETY: a valid rlimit; a null old-limit pointer is allowed.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit on {pid}: {}", std::io::Error::last_os_error());
}

fn raise_own_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid pointers to an rlimit.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is index 0; utime and stime are fields 14 and 15 of stat.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// Opens `n` plain connections to each address (from threads, all at once); returns them.
fn flood(addrs: &[String]) -> Vec<TcpStream> {
    let threads: Vec<_> = addrs
        .iter()
        .cloned()
        .map(|a| {
            std::thread::spawn(move || {
                let sa: SocketAddr = a.parse().unwrap();
                (0..FLOOD_CONNECTIONS).filter_map(|_| TcpStream::connect_timeout(&sa, Duration::from_millis(500)).ok()).collect::<Vec<_>>()
            })
        })
        .collect();
    threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
}

/// Connects and never authenticates; true if the server closed the connection within `bound`.
fn idle_closed_within(addr: &str, bound: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).map_err(|e| format!("{addr}: connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < bound {
        match s.read(&mut buf) {
            Ok(0) => return Ok(t0.elapsed()),
            Ok(_) => {} // a greeting or challenge
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Ok(t0.elapsed()), // reset
        }
    }
    Err(format!("{addr}: an unauthenticated idle connection was still open after {bound:?}"))
}

/// Checks every address in parallel; the failures.
fn idle_checks(addrs: &[String]) -> Vec<String> {
    let threads: Vec<_> = addrs.iter().cloned().map(|a| std::thread::spawn(move || idle_closed_within(&a, IDLE_CLOSE_BOUND))).collect();
    threads.into_iter().filter_map(|t| t.join().unwrap().err()).collect()
}

/// Floods `ports` of the processes `pids` (limits lowered first), holding the flood for
/// [`HOLD`]; returns the CPU share of one core each process used while flooded.
fn flood_processes(pids: &[u32], ports: &[String]) -> Vec<f64> {
    for &p in pids {
        set_fd_limit(p, FD_LIMIT);
    }
    let conns = flood(ports);
    assert!(conns.len() > FD_LIMIT as usize, "the flood opened only {} connections", conns.len());
    let before: Vec<u64> = pids.iter().map(|&p| cpu_ticks(p)).collect();
    let t0 = Instant::now();
    std::thread::sleep(HOLD);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let shares = pids.iter().zip(before).map(|(&p, b)| (cpu_ticks(p) - b) as f64 / hz / t0.elapsed().as_secs_f64()).collect();
    drop(conns);
    // Give the daemons a moment to see the closes (and to back off from any accept error).
    std::thread::sleep(Duration::from_millis(300));
    shares
}

#[test]
fn volume_cluster_survives_a_connection_flood() {
    require_qemu();
    raise_own_fd_limit();
    let up = Up::start(3);
    let up_pid = up.info["up_pid"].as_u64().unwrap() as u32;
    let mut pids = vec![up.info["meta"]["pid"].as_u64().unwrap() as u32, up.info["nbd"]["pid"].as_u64().unwrap() as u32];
    let mut ports = vec![up.meta_addr(), up.info["nbd"]["addr"].as_str().unwrap().to_string()];
    for s in up.info["shards"].as_array().unwrap() {
        pids.push(s["pid"].as_u64().unwrap() as u32);
        ports.push(s["addr"].as_str().unwrap().to_string());
    }
    flood_processes(&pids, &ports);
    for (&pid, port) in pids.iter().zip(&ports) {
        assert!(alive(pid), "the daemon on {port} (pid {pid}) died in the flood");
    }
    assert!(alive(up_pid), "understudy up exited after the flood:\n{}", up.up_output());

    // A good client is served: create a volume (metadata service), write and read it over NBD
    // (NBD server and shards).
    up.ok(&["volume", "create", "flooded", "--size", "8M"]);
    qemu_ok(&up.uri("flooded"), &["write -P 0x3c 0 256k", "read -P 0x3c 0 256k"]);
    let bad = idle_checks(&ports);
    assert!(bad.is_empty(), "{bad:?}");
    for (&pid, port) in pids.iter().zip(&ports) {
        assert!(alive(pid), "the daemon on {port} (pid {pid}) died");
    }

    // One daemon exiting (here the metadata service, killed) does not make `up` stop the
    // others: the NBD server and the shards keep running (and up starts it again).
    // SAFETY: kill(2) on a pid this test's cluster owns.
    unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(2000));
    assert!(alive(up_pid), "understudy up exited when the metadata service did:\n{}", up.up_output());
    for (&pid, port) in pids.iter().zip(&ports).skip(1) {
        assert!(alive(pid), "the daemon on {port} (pid {pid}) was stopped when the metadata service exited");
    }
    assert!(up.up_output().contains("metadata service exited"), "up reports the exit:\n{}", up.up_output());
}

#[test]
fn nearlog_up_survives_a_connection_flood() {
    raise_own_fd_limit();
    let tmp = tempfile::tempdir().unwrap();
    let (guard, cluster_file) = nearlog_common::start_cluster(tmp.path());
    let pid = guard.0.id();
    let cf: serde_json::Value = serde_json::from_slice(&std::fs::read(&cluster_file).unwrap()).unwrap();
    let controller = cf["controller"].as_str().unwrap().to_string();
    let mut ports = vec![controller.clone()];
    ports.extend(cf["peers"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()));
    let secret = std::fs::read_to_string(cf["secret_file"].as_str().unwrap()).unwrap().trim().as_bytes().to_vec();

    // The controller and the peers are processes of their own (DIR/pids): each is flooded at
    // its own descriptor limit.
    let daemons: Vec<u32> = std::fs::read_to_string(tmp.path().join("pids"))
        .unwrap()
        .lines()
        .map(|l| l.split_once(' ').unwrap().1.trim().parse().unwrap())
        .collect();
    assert_eq!(daemons.len(), 4, "a controller and 3 peers");
    flood_processes(&daemons, &ports);
    assert!(alive(pid), "nearlog up died in the flood");
    for &d in &daemons {
        assert!(alive(d), "a nearlog daemon (pid {d}) died in the flood");
    }

    // A good client: open a log file (controller) and write it on a majority of its peers.
    use nearlog::core::file_client::{ClientConfig, FileClient};
    use nearlog::proto::{CtlReply, CtlRequest, Op};
    let deadline = Instant::now() + Duration::from_secs(20);
    let g = loop {
        match nearlog::driver::mover::ctl_call(&controller, &secret, &CtlRequest::Open { key: "flooded.log".into(), replicas: 3 }) {
            Ok(CtlReply::Granted(g)) => break g,
            other => assert!(Instant::now() < deadline, "the controller does not serve after the flood: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut d = nearlog::driver::mover::Driver::new(&secret);
    d.learn(&g);
    let ids: Vec<_> = g.peers.iter().map(|p| p.id).collect();
    let mut c = FileClient::open(g.file, g.epoch, ids, g.initialized, Vec::new(), ClientConfig::default(), d.now_us());
    d.run(&mut c, deadline, |c| c.is_ready()).expect("open the log file on its peers after the flood");
    let seq = c.submit(Op::write(0, b"after the flood".to_vec())).expect("submit a write");
    d.run(&mut c, deadline, |c| c.acked_seq() >= seq).expect("a write acknowledged by the peers after the flood");
    // Every peer (not only a majority) serves.
    d.run(&mut c, deadline, |c| c.fully_replicated()).expect("every peer serves after the flood");

    let bad = idle_checks(&ports);
    assert!(bad.is_empty(), "{bad:?}");
    assert!(alive(pid), "nearlog up died");
    for &d in &daemons {
        assert!(alive(d), "a nearlog daemon (pid {d}) died");
    }
}

struct KvUp {
    child: std::process::Child,
}
impl Drop for KvUp {
    fn drop(&mut self) {
        // `kv up` stops its children on SIGTERM.
        stop_child(&mut self.child, Duration::from_secs(10));
    }
}

fn kv_pid(dir: &Path, name: &str) -> u32 {
    let text = std::fs::read_to_string(dir.join("pids")).unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().trim().parse().unwrap()
}

fn kv_cli(cluster: &Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(["kv"]).args(args).arg("--cluster").arg(cluster).stdin(Stdio::null()).output().unwrap()
}

#[test]
fn kv_up_survives_a_connection_flood() {
    raise_own_fd_limit();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let child = Command::new(BIN)
        .args(["kv", "up", "--dir", dir.to_str().unwrap(), "--nodes", "3", "--port-base", "0"])
        .args(["--failure-timeout-ms", "2000", "--lease-ms", "800"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("up.log")).unwrap())
        .spawn()
        .unwrap();
    let _up = KvUp { child };
    let cf = dir.join("kv-cluster.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if cf.exists() && kv_cli(&cf, &["put", "k0", "v0"]).status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "kv up did not serve: {}", std::fs::read_to_string(tmp.path().join("up.log")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(200));
    }
    let f: serde_json::Value = serde_json::from_slice(&std::fs::read(&cf).unwrap()).unwrap();
    let ports: Vec<String> = f["nodes"].as_object().unwrap().values().map(|v| v.as_str().unwrap().to_string()).collect();
    let pids: Vec<u32> = (0..3).map(|i| kv_pid(&dir, &format!("node-{i}"))).collect();

    let cpu = flood_processes(&pids, &ports);
    eprintln!("kv nodes' CPU share of one core while flooded: {cpu:?}");
    for (&pid, share) in pids.iter().zip(&cpu) {
        assert!(alive(pid), "kv node pid {pid} died in the flood (kv up may have restarted it)");
        // Out of descriptors, a node must wait, not retry accept in a loop (it burned a core).
        assert!(*share < 0.2, "kv node pid {pid} used {:.0}% of a core while flooded", share * 100.0);
    }
    let out = kv_cli(&cf, &["put", "k1", "after the flood"]);
    assert!(out.status.success(), "kv put after the flood: {}", String::from_utf8_lossy(&out.stderr));
    let out = kv_cli(&cf, &["get", "k1"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "after the flood", "kv get: {}", String::from_utf8_lossy(&out.stderr));
    let bad = idle_checks(&ports);
    assert!(bad.is_empty(), "{bad:?}");
    for (i, &pid) in pids.iter().enumerate() {
        assert_eq!(kv_pid(&dir, &format!("node-{i}")), pid, "node-{i} was restarted");
    }
}
