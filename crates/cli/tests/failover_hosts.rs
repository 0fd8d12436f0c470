//! Failover across hosts (issue 24, item 5), on [`testbed::hostbed`]: three hosts (network
//! namespaces) each with an etcd member, a metadata service and a shard of the volume system,
//! and a failover agent (`failover agent`); monitors (`failover run --store … --agents`) and
//! client endpoints (`failover endpoint`) on the hosts; the SQLite front as the application,
//! under the load generator from the client host through an endpoint on a surviving host.
//!
//! * The primary's host dies (every process in it SIGKILLed, its link cut): the monitor on
//!   another host promotes the backup, which runs on a third host; the endpoint re-points; no
//!   acknowledged commit is lost. The time from the host's death to the first commit the
//!   promoted primary acknowledges is printed (`failover.host_loss.serving_ms`).
//! * The host of the leading monitor *and* the primary dies: a standby monitor on another host
//!   takes over, finds the placement the dead leader recorded, and fails over the same way.
//!
//! Root only (network namespaces, FUSE, loop devices): skipped otherwise, with a message; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without FUSE.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use testbed::hostbed::{HostBed, ELECTION_TTL, SERVER_HOSTS};
use volume::driver::meta::{MetaReq, MetaResp};

const BIN: &str = env!("CARGO_BIN_EXE_understudy");
/// Bound of every wait (an attach with mkfs, a promotion across a dead host's shard and maybe
/// its metadata leader, on a loaded 2-core machine).
const WAIT: Duration = Duration::from_secs(45);
/// Commits that show the load flows.
const FLOWING_COMMITS: usize = 20;
/// The agents' lease: a dead host's instances count as fenced this long after its death. Past
/// the store's own recovery from losing a member (its leader, maybe) on a loaded machine: with
/// 2 s, the surviving agents lost theirs while etcd re-elected, and fenced every instance.
const AGENT_LEASE_MS: u64 = 10_000;

/// One bed at a time: each is 3 etcd members and a dozen daemons on a loaded 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn bed() -> Option<(std::sync::MutexGuard<'static, ()>, HostBed)> {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return None;
    }
    if let Err(e) = testbed::hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Some((g, HostBed::start(BIN.as_ref()).expect("host bed with etcd")))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// A free `address:port` on host `i`.
fn addr_on(bed: &HostBed, i: usize) -> String {
    format!("{}:{}", bed.host(i).addr(), wire::ports::free_loopback_port().unwrap())
}

/// The application's daemons on the bed, and what cleans up after them.
struct App {
    metas: String,
    spec: PathBuf,
    /// Host i's agent's state directory.
    agent_dirs: Vec<PathBuf>,
    /// Monitor name → control address.
    controls: Vec<(String, SocketAddr)>,
}

const VOL: &str = "fo";

impl App {
    /// The volume system, the volume, the spec and an agent per server host; waits until the
    /// agents are registered.
    fn start(bed: &HostBed, rt: &tokio::runtime::Runtime) -> App {
        let sys = bed.start_volume().unwrap();
        let metas = sys.meta_list();
        rt.block_on(async {
            let deadline = Instant::now() + WAIT;
            let c = loop {
                match volume::driver::client::Cluster::connect(&metas, bed.secret()).await {
                    Ok(c) => break c,
                    Err(e) => assert!(Instant::now() < deadline, "no metadata service at {metas}: {e:#}"),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            loop {
                if let Ok(MetaResp::Map(m)) = c.meta(MetaReq::GetMap).await {
                    if m.shards.iter().filter(|s| s.state == volume::types::ShardState::Up).count() == SERVER_HOSTS {
                        break;
                    }
                }
                assert!(Instant::now() < deadline, "the shards did not come up");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let r = c.meta(MetaReq::Create { name: VOL.into(), size_bytes: 128 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
            assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
        });
        let spec = serde_json::json!({
            "volume": VOL,
            // Unused with --agents (the agents keep the instances' state).
            "state_dir": bed.dir().join("monitor"),
            "mkfs": true,
            "app": { "command": ["sh", "-c", "exec \"$0\" failover sqlite-front --db \"$UNDERSTUDY_MOUNT/app.db\" --port \"$UNDERSTUDY_PORT\"", BIN], "stop_grace_ms": 5000 },
            "health": { "send": "PING", "expect": "PONG", "timeout_ms": 1000 },
            // Not bound on the store: the endpoints are `failover endpoint`.
            "endpoint": { "listen": "127.0.0.1:1" },
            "monitor": { "policy": "speculative", "ping_interval_ms": 250, "reds_timeout_ms": 30000, "healthy_timeout_ms": 60000, "max_backup_starts": 2 },
            "network": { "namespaces": "off" },
        });
        let spec_path = bed.dir().join("spec.json");
        std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        let (url, sf) = (bed.store_url(), bed.secret_file().display().to_string());
        let mut agent_dirs = vec![];
        for i in 0..SERVER_HOSTS {
            let dir = bed.dir().join(format!("agent-h{i}"));
            let args = s(&[
                "failover", "agent", "--store", &url, "--host", &format!("h{i}"), "--listen", &addr_on(bed, i),
                "--state-dir", &dir.display().to_string(), "--lease-ttl-ms", &AGENT_LEASE_MS.to_string(),
                "--meta", &metas, "--secret-file", &sf,
            ]);
            bed.spawn(i, &format!("agent-h{i}"), &args).unwrap();
            agent_dirs.push(dir);
        }
        let app = App { metas, spec: spec_path, agent_dirs, controls: vec![] };
        let store = app.store(bed, rt);
        rt.block_on(async {
            let deadline = Instant::now() + WAIT;
            while store.live(::failover::agent::proto::AGENT_KIND).await.map(|l| l.len()).unwrap_or(0) < SERVER_HOSTS {
                assert!(Instant::now() < deadline, "the agents did not register: {}", bed.tail("agent-h0", 20));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        app
    }

    fn store(&self, bed: &HostBed, rt: &tokio::runtime::Runtime) -> control::Store {
        rt.block_on(control::Store::open(&bed.store_url(), "failover", &control::daemon::cluster_id_from_secret("failover", bed.secret()))).unwrap()
    }

    /// `failover run SPEC --store … --agents` on host `i` as `mon-hI`.
    fn monitor(&mut self, bed: &HostBed, i: usize) -> String {
        let name = format!("mon-h{i}");
        let control = addr_on(bed, i);
        let args = s(&[
            "failover", "run", &self.spec.display().to_string(), "--store", &bed.store_url(), "--agents",
            "--election-ttl-ms", &ELECTION_TTL.as_millis().to_string(), "--advertise", &name, "--control", &control,
            "--meta", &self.metas, "--secret-file", &bed.secret_file().display().to_string(),
        ]);
        bed.spawn(i, &name, &args).unwrap();
        self.controls.push((name.clone(), control.parse().unwrap()));
        name
    }

    /// `failover endpoint` on host `i`; returns where clients connect.
    fn endpoint(&self, bed: &HostBed, i: usize) -> SocketAddr {
        let listen = addr_on(bed, i);
        let args = s(&["failover", "endpoint", "--store", &bed.store_url(), "--name", VOL, "--listen", &listen, "--secret-file", &bed.secret_file().display().to_string()]);
        bed.spawn(i, &format!("endpoint-h{i}"), &args).unwrap();
        listen.parse().unwrap()
    }

    fn control(&self, name: &str) -> SocketAddr {
        self.controls.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// The leading monitor's status, once settled.
    fn wait_settled(&self, bed: &HostBed, monitor: &str) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let st = testbed::failover::control_request(self.control(monitor), bed.secret(), "status").ok().and_then(|j| serde_json::from_str::<Value>(&j).ok());
            if let Some(st) = &st {
                if st["settled"] == true {
                    return st.clone();
                }
            }
            assert!(Instant::now() < deadline, "monitor {monitor} did not settle within {WAIT:?}: {st:?}\n{}", bed.tail(monitor, 30));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Stops whatever still runs of the application when the test ends, pass or fail: the
/// monitors first (SIGKILL: no more decisions), then the agents (SIGTERM: each stops its
/// instances and detaches their volumes), then whatever volume is still attached, the dead
/// host's too (its helper died with it: `volume detach` cleans up after a dead one). The bed
/// kills everything else when the test's thread ends.
struct Cleanup<'a> {
    bed: &'a HostBed,
    agent_dirs: Vec<PathBuf>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for i in 0..SERVER_HOSTS {
            if let Some(pid) = self.bed.pid(&format!("mon-h{i}")) {
                testbed::proc::signal(pid, libc::SIGKILL);
            }
        }
        let agents: Vec<String> = (0..SERVER_HOSTS).map(|i| format!("agent-h{i}")).collect();
        for a in &agents {
            if let (Some(pid), None) = (self.bed.pid(a), self.bed.exit_status(a)) {
                testbed::proc::signal(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + WAIT;
        while agents.iter().any(|a| self.bed.pid(a).is_some() && self.bed.exit_status(a).is_none()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        for d in &self.agent_dirs {
            let Ok(apps) = std::fs::read_dir(d) else { continue };
            for app in apps.flatten() {
                let Ok(mounts) = std::fs::read_dir(app.path().join("mnt")) else { continue };
                for m in mounts.flatten() {
                    let o = std::process::Command::new(BIN).args(["volume", "detach"]).arg(m.path()).stdin(Stdio::null()).output();
                    if let Ok(o) = o {
                        if o.status.success() {
                            eprintln!("detached {}", m.path().display());
                        }
                    }
                }
            }
        }
    }
}

/// The load generator on the client host through an endpoint, its acknowledged commits
/// counted as it goes.
struct Load {
    child: Option<Child>,
    acked: Arc<Mutex<usize>>,
}

impl Load {
    fn start(bed: &HostBed, endpoint: SocketAddr) -> Load {
        let mut c = bed
            .client()
            .command(BIN)
            .args(["failover", "load", "--endpoint", &endpoint.to_string(), "--duration-ms", "600000", "--progress-ms", "20"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let acked = Arc::new(Mutex::new(0));
        let (err, a) = (c.stderr.take().unwrap(), acked.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v["acked"].is_u64() => *a.lock().unwrap() = v["acked"].as_u64().unwrap() as usize,
                    _ => eprintln!("load: {line}"),
                }
            }
        });
        Load { child: Some(c), acked }
    }

    fn acked(&self) -> usize {
        *self.acked.lock().unwrap()
    }

    /// Waits until `n` commits are acknowledged; returns when.
    fn wait_acked(&self, n: usize, what: &str) -> Instant {
        let deadline = Instant::now() + WAIT;
        while self.acked() < n {
            assert!(Instant::now() < deadline, "{what}: {} of {n} commits acknowledged within {WAIT:?}", self.acked());
            std::thread::sleep(Duration::from_millis(5));
        }
        Instant::now()
    }

    /// Stops the load (SIGTERM); it checks the table through the endpoint; asserts nothing
    /// acknowledged is missing.
    fn finish(mut self) -> Value {
        let mut c = self.child.take().unwrap();
        testbed::proc::signal(c.id(), libc::SIGTERM);
        let mut out = c.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("the load did not finish its check within {WAIT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = reader.join().unwrap();
        let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap_or_else(|_| panic!("load printed no JSON: {stdout}"));
        assert!(status.success(), "the load check failed: {v}");
        assert_eq!(v["ok"], true, "{v}");
        assert!(v["verdict"]["missing"].as_array().unwrap().is_empty(), "acknowledged commits lost: {v}");
        assert!(v["verdict"]["unexpected"].as_array().unwrap().is_empty(), "rows never attempted: {v}");
        v
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The first JSON line of daemon `name`'s log with `"event": event` (and `pred`), waited for.
fn wait_event(bed: &HostBed, name: &str, event: &str, timeout: Duration) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(bed.log(name)).unwrap_or_default();
        if let Some(v) = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v["event"] == event) {
            return v;
        }
        assert!(Instant::now() < deadline, "{name}: no {event} within {timeout:?}:\n{}", bed.tail(name, 40));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The first of `names` whose log has a JSON line with `"event": event`, and that line.
fn wait_event_any(bed: &HostBed, names: &[String], event: &str, timeout: Duration) -> (String, Value) {
    let deadline = Instant::now() + timeout;
    loop {
        for name in names {
            let text = std::fs::read_to_string(bed.log(name)).unwrap_or_default();
            if let Some(v) = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v["event"] == event) {
                return (name.clone(), v);
            }
        }
        let tails: Vec<String> = names.iter().map(|n| format!("--- {n}:\n{}", bed.tail(n, 40))).collect();
        assert!(Instant::now() < deadline, "no {event} from {names:?} within {timeout:?}:\n{}", tails.join("\n"));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls the monitors' election until `want` leads.
fn wait_leading(bed: &HostBed, store: &control::Store, rt: &tokio::runtime::Runtime, want: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        if rt.block_on(store.observe(&::failover::driver::store::election(VOL))).ok().flatten().as_deref() == Some(want) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < WAIT, "{want} does not lead within {WAIT:?}:\n{}", bed.tail(want, 30));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The host (`hI`) the leading monitor's status places instance `id` on.
fn host_of(status: &Value, id: &Value) -> String {
    let insts = status["instances"].as_array().unwrap();
    let i = insts.iter().find(|i| &i["id"] == id).unwrap_or_else(|| panic!("instance {id} not in {status}"));
    i["host"].as_str().unwrap_or_else(|| panic!("instance {id} has no host: {status}")).to_string()
}

fn host_index(host: &str) -> usize {
    host.strip_prefix('h').and_then(|i| i.parse().ok()).unwrap_or_else(|| panic!("{host} names no host"))
}

/// The scenario of both tests: the primary on one host, the load through an endpoint on
/// another; that host killed (with the leading monitor when `with_monitor`); the backup
/// promoted on a third host; nothing acknowledged lost.
fn lose_the_primarys_host(with_monitor: bool) {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let mut app = App::start(&bed, &rt);
        let _cleanup = Cleanup { bed: &bed, agent_dirs: app.agent_dirs.clone() };
        let store = app.store(&bed, &rt);
        // The primary goes to h0 (every agent live, none occupied: the first by name). The
        // leader is on h0 too when the monitor dies with it, else on h1; a standby on h2.
        let first = app.monitor(&bed, if with_monitor { 0 } else { 1 });
        wait_leading(&bed, &store, &rt, &first);
        let standby = app.monitor(&bed, 2);
        let ep = app.endpoint(&bed, 1);
        app.endpoint(&bed, 2);
        wait_event(&bed, &first, "primary_up", WAIT);
        let st = app.wait_settled(&bed, &first);
        let primary = st["state"]["primary"].clone();
        let lost = host_index(&host_of(&st, &primary));
        assert_eq!(lost, 0, "the primary goes to the first live host: {st}");
        wait_event(&bed, &standby, "standing", WAIT);

        let load = Load::start(&bed, ep);
        load.wait_acked(FLOWING_COMMITS, "before the host's death");
        let acked_at_kill = load.acked();
        let load_at_kill = loadavg();
        let killed_unix_ms = now_unix_ms();
        let killed = Instant::now();
        bed.kill_host(lost).unwrap();

        if with_monitor {
            let takeover = wait_leading(&bed, &store, &rt, &standby);
            eprintln!("the monitor's host died with the primary's: {standby} leads {} ms after", takeover.as_millis());
        }
        // Whichever monitor leads promotes: the surviving leader may also lose its election
        // lease while etcd re-elects after losing a member, exit, and leave it to the standby.
        let survivors: Vec<String> = [first.clone(), standby.clone()].into_iter().filter(|m| host_index(&m[m.len() - 2..]) != lost).collect();
        let (leader, promoted) = wait_event_any(&bed, &survivors, "promoted", WAIT + WAIT);
        // The promoted primary serves: the first commit acknowledged after the death.
        let serving = load.wait_acked(acked_at_kill + 1, "after the promotion") - killed;
        load.wait_acked(load.acked() + FLOWING_COMMITS, "after the promotion");
        let st = app.wait_settled(&bed, &leader);
        assert_eq!(st["state"]["primary"], promoted["instance"], "{st}");
        let new_host = host_index(&host_of(&st, &promoted["instance"]));
        assert_ne!(new_host, lost, "the promoted backup runs on another host: {st}");
        // The endpoints follow the record the leader published: the promoted one, on its host.
        let rec = rt.block_on(::failover::driver::store::read_primary(&store, VOL)).unwrap().unwrap().0;
        assert_eq!(rec.instance.map(|i| i.0), promoted["instance"].as_u64(), "{rec:?}");
        assert_eq!(rec.addr.map(|a| a.ip()), Some(std::net::IpAddr::V4(bed.host(new_host).addr())), "{rec:?}");
        let verdict = load.finish();
        eprintln!(
            "{}",
            serde_json::json!({
                "figure": "failover.host_loss.serving_ms", "with_monitor": with_monitor,
                "serving_ms": serving.as_millis() as u64,
                "promoted_ms": promoted["unix_ms"].as_u64().unwrap_or(0).saturating_sub(killed_unix_ms),
                "acked": verdict["acked"], "max_gap_ms": verdict["max_gap_ms"],
                "from": format!("h{lost}"), "to": format!("h{new_host}"), "promoted_by": leader, "loadavg_at_kill": load_at_kill, "loadavg": loadavg(),
            })
        );
    })
    .unwrap();
}

/// The primary's host dies under load: the monitor (on another host) promotes the backup on a
/// third host, the endpoint on a surviving host re-points, no acknowledged commit is lost.
#[test]
fn losing_the_primarys_host_promotes_the_backup_on_another_host() {
    lose_the_primarys_host(false);
}

/// The host of the leading monitor and of the primary dies under load: the standby monitor on
/// another host takes over, knows where the instances were from the recorded placement, and
/// fails over the same way.
#[test]
fn losing_the_host_of_the_leading_monitor_and_the_primary() {
    lose_the_primarys_host(true);
}
