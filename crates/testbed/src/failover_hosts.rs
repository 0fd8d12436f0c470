//! The failover application across hosts on a [`HostBed`] (issue 24 items 5 and 8): what the
//! `failover_hosts` test and `bench control failover` both run, so the figure the bench reports
//! is the one the test checks.
//!
//! The volume system on the bed, one volume, a failover agent per server host (`failover
//! agent`), monitors (`failover run --store … --agents`) and client endpoints (`failover
//! endpoint`) on chosen hosts, the SQLite front as the application and `failover load` on the
//! client host as its load. Call everything from the bed's client thread
//! ([`HostBed::in_client`]): the daemons die with the thread that starts them, and the store is
//! reachable from the hosts only.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::Value;
use volume::driver::meta::{MetaReq, MetaResp};

use crate::hostbed::{HostBed, SERVER_HOSTS};

/// Bound of every wait (an attach with mkfs, a promotion across a dead host's shard and maybe
/// its metadata leader, on a loaded 2-core machine).
pub const WAIT: Duration = Duration::from_secs(45);
/// The agents' lease: a dead host's instances count as fenced this long after its death. Past
/// the store's own recovery from losing a member (its leader, maybe) on a loaded machine: with
/// 2 s, the surviving agents lost theirs while etcd re-elected, and fenced every instance.
pub const AGENT_LEASE_MS: u64 = 10_000;
/// The volume the application runs on.
pub const VOL: &str = "fo";
/// Its size.
pub const VOL_BYTES: u64 = 128 << 20;

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// A free `address:port` on host `i`.
fn addr_on(bed: &HostBed, i: usize) -> anyhow::Result<String> {
    Ok(format!(
        "{}:{}",
        bed.host(i).addr(),
        wire::ports::free_loopback_port()?
    ))
}

/// The application's daemons on the bed.
pub struct FailoverApp {
    pub metas: String,
    pub spec: PathBuf,
    /// Host i's agent's state directory.
    pub agent_dirs: Vec<PathBuf>,
    /// Monitor name → control address.
    controls: Vec<(String, SocketAddr)>,
}

impl FailoverApp {
    /// The volume system, the volume, the spec and an agent per server host; waits until the
    /// agents are registered.
    pub fn start(bed: &HostBed, rt: &tokio::runtime::Runtime) -> anyhow::Result<FailoverApp> {
        let sys = bed.start_volume()?;
        let metas = sys.meta_list();
        rt.block_on(async {
            let deadline = Instant::now() + WAIT;
            let c = loop {
                match volume::driver::client::Cluster::connect(&metas, bed.secret()).await {
                    Ok(c) => break c,
                    Err(e) => ensure!(
                        Instant::now() < deadline,
                        "no metadata service at {metas}: {e:#}"
                    ),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            loop {
                if let Ok(MetaResp::Map(m)) = c.meta(MetaReq::GetMap).await {
                    if m.shards
                        .iter()
                        .filter(|s| s.state == volume::types::ShardState::Up)
                        .count()
                        == SERVER_HOSTS
                    {
                        break;
                    }
                }
                ensure!(
                    Instant::now() < deadline,
                    "the shards did not come up within {WAIT:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let r = c
                .meta(MetaReq::Create {
                    name: VOL.into(),
                    size_bytes: VOL_BYTES,
                    object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES,
                })
                .await?;
            ensure!(matches!(r, MetaResp::Volume(_)), "creating {VOL}: {r:?}");
            Ok(())
        })?;
        let bin = bed.bin().display().to_string();
        let spec = serde_json::json!({
            "volume": VOL,
            // Unused with --agents (the agents keep the instances' state).
            "state_dir": bed.dir().join("monitor"),
            "mkfs": true,
            "app": { "command": ["sh", "-c", "exec \"$0\" failover sqlite-front --db \"$UNDERSTUDY_MOUNT/app.db\" --port \"$UNDERSTUDY_PORT\"", bin], "stop_grace_ms": 5000 },
            "health": { "send": "PING", "expect": "PONG", "timeout_ms": 1000 },
            // Not bound on the store: the endpoints are `failover endpoint`.
            "endpoint": { "listen": "127.0.0.1:1" },
            "monitor": { "policy": "speculative", "ping_interval_ms": 250, "reds_timeout_ms": 30000, "healthy_timeout_ms": 60000, "max_backup_starts": 2 },
            "network": { "namespaces": "off" },
        });
        let spec_path = bed.dir().join("spec.json");
        std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec)?)?;
        let (url, sf) = (bed.store_url(), bed.secret_file().display().to_string());
        let mut agent_dirs = vec![];
        for i in 0..SERVER_HOSTS {
            let dir = bed.dir().join(format!("agent-h{i}"));
            let args = s(&[
                "failover",
                "agent",
                "--store",
                &url,
                "--host",
                &format!("h{i}"),
                "--listen",
                &addr_on(bed, i)?,
                "--state-dir",
                &dir.display().to_string(),
                "--lease-ttl-ms",
                &AGENT_LEASE_MS.to_string(),
                "--meta",
                &metas,
                "--secret-file",
                &sf,
            ]);
            bed.spawn(i, &format!("agent-h{i}"), &args)?;
            agent_dirs.push(dir);
        }
        let app = FailoverApp {
            metas,
            spec: spec_path,
            agent_dirs,
            controls: vec![],
        };
        let store = app.store(bed, rt)?;
        rt.block_on(async {
            let deadline = Instant::now() + WAIT;
            while store
                .live(::failover::agent::proto::AGENT_KIND)
                .await
                .map(|l| l.len())
                .unwrap_or(0)
                < SERVER_HOSTS
            {
                ensure!(
                    Instant::now() < deadline,
                    "the agents did not register: {}",
                    bed.tail("agent-h0", 20)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(())
        })?;
        Ok(app)
    }

    /// The failover system's store (its cluster on the bed's etcd).
    pub fn store(
        &self,
        bed: &HostBed,
        rt: &tokio::runtime::Runtime,
    ) -> anyhow::Result<control::Store> {
        Ok(rt.block_on(control::Store::open(
            &bed.store_url(),
            "failover",
            &control::daemon::cluster_id_from_secret("failover", bed.secret()),
        ))?)
    }

    /// `failover run SPEC --store … --agents` on host `i` as `mon-hI`, its election lease
    /// `election_ttl`.
    pub fn monitor(
        &mut self,
        bed: &HostBed,
        i: usize,
        election_ttl: Duration,
    ) -> anyhow::Result<String> {
        let name = format!("mon-h{i}");
        let control = addr_on(bed, i)?;
        let args = s(&[
            "failover",
            "run",
            &self.spec.display().to_string(),
            "--store",
            &bed.store_url(),
            "--agents",
            "--election-ttl-ms",
            &election_ttl.as_millis().to_string(),
            "--advertise",
            &name,
            "--control",
            &control,
            "--meta",
            &self.metas,
            "--secret-file",
            &bed.secret_file().display().to_string(),
        ]);
        bed.spawn(i, &name, &args)?;
        self.controls.push((name.clone(), control.parse()?));
        Ok(name)
    }

    /// `failover endpoint` on host `i`; returns where clients connect.
    pub fn endpoint(&self, bed: &HostBed, i: usize) -> anyhow::Result<SocketAddr> {
        let listen = addr_on(bed, i)?;
        let args = s(&[
            "failover",
            "endpoint",
            "--store",
            &bed.store_url(),
            "--name",
            VOL,
            "--listen",
            &listen,
            "--secret-file",
            &bed.secret_file().display().to_string(),
        ]);
        bed.spawn(i, &format!("endpoint-h{i}"), &args)?;
        Ok(listen.parse()?)
    }

    fn control(&self, name: &str) -> anyhow::Result<SocketAddr> {
        self.controls
            .iter()
            .find(|(n, _)| n == name)
            .map(|c| c.1)
            .with_context(|| format!("no monitor {name}"))
    }

    /// The leading monitor's status, once settled.
    pub fn wait_settled(&self, bed: &HostBed, monitor: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + WAIT;
        let control = self.control(monitor)?;
        loop {
            let st = crate::failover::control_request(control, bed.secret(), "status")
                .ok()
                .and_then(|j| serde_json::from_str::<Value>(&j).ok());
            if let Some(st) = &st {
                if st["settled"] == true {
                    return Ok(st.clone());
                }
            }
            ensure!(
                Instant::now() < deadline,
                "monitor {monitor} did not settle within {WAIT:?}: {st:?}\n{}",
                bed.tail(monitor, 30)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Stops whatever still runs of the application when dropped, pass or fail: the monitors
/// first (SIGKILL: no more decisions), then the agents (SIGTERM: each stops its instances and
/// detaches their volumes), then whatever volume is still attached, the dead host's too (its
/// helper died with it: `volume detach` cleans up after a dead one). The bed kills everything
/// else when its thread ends.
pub struct Cleanup<'a> {
    pub bed: &'a HostBed,
    pub agent_dirs: Vec<PathBuf>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for i in 0..SERVER_HOSTS {
            if let Some(pid) = self.bed.pid(&format!("mon-h{i}")) {
                crate::proc::signal(pid, libc::SIGKILL);
            }
        }
        let agents: Vec<String> = (0..SERVER_HOSTS).map(|i| format!("agent-h{i}")).collect();
        for a in &agents {
            if let (Some(pid), None) = (self.bed.pid(a), self.bed.exit_status(a)) {
                crate::proc::signal(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + WAIT;
        while agents
            .iter()
            .any(|a| self.bed.pid(a).is_some() && self.bed.exit_status(a).is_none())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        for d in &self.agent_dirs {
            let Ok(apps) = std::fs::read_dir(d) else {
                continue;
            };
            for app in apps.flatten() {
                let Ok(mounts) = std::fs::read_dir(app.path().join("mnt")) else {
                    continue;
                };
                for m in mounts.flatten() {
                    let o = std::process::Command::new(self.bed.bin())
                        .args(["volume", "detach"])
                        .arg(m.path())
                        .stdin(Stdio::null())
                        .output();
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
pub struct Load {
    child: Option<Child>,
    acked: Arc<Mutex<usize>>,
}

impl Load {
    pub fn start(bed: &HostBed, endpoint: SocketAddr) -> anyhow::Result<Load> {
        let mut c = bed
            .client()
            .command(bed.bin())
            .args([
                "failover",
                "load",
                "--endpoint",
                &endpoint.to_string(),
                "--duration-ms",
                "600000",
                "--progress-ms",
                "20",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start `failover load`")?;
        let acked = Arc::new(Mutex::new(0));
        let (err, a) = (c.stderr.take().context("no stderr")?, acked.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v["acked"].is_u64() => {
                        *a.lock().unwrap() = v["acked"].as_u64().unwrap() as usize
                    }
                    _ => eprintln!("load: {line}"),
                }
            }
        });
        Ok(Load {
            child: Some(c),
            acked,
        })
    }

    pub fn acked(&self) -> usize {
        *self.acked.lock().unwrap()
    }

    /// Waits until `n` commits are acknowledged; returns when.
    pub fn wait_acked(&self, n: usize, what: &str) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + WAIT;
        while self.acked() < n {
            ensure!(
                Instant::now() < deadline,
                "{what}: {} of {n} commits acknowledged within {WAIT:?}",
                self.acked()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(Instant::now())
    }

    /// Stops the load (SIGTERM); it checks the table through the endpoint. Its verdict, an
    /// error if anything acknowledged is missing or a row never attempted is there.
    pub fn finish(mut self) -> anyhow::Result<Value> {
        let mut c = self.child.take().context("finished twice")?;
        crate::proc::signal(c.id(), libc::SIGTERM);
        let mut out = c.stdout.take().context("no stdout")?;
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(s) = c.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                bail!("the load did not finish its check within {WAIT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = reader.join().unwrap_or_default();
        let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or("null"))
            .with_context(|| format!("load printed no JSON: {stdout}"))?;
        ensure!(status.success(), "the load check failed: {v}");
        ensure!(v["ok"] == true, "{v}");
        ensure!(
            v["verdict"]["missing"]
                .as_array()
                .is_some_and(|m| m.is_empty()),
            "acknowledged commits lost: {v}"
        );
        ensure!(
            v["verdict"]["unexpected"]
                .as_array()
                .is_some_and(|m| m.is_empty()),
            "rows never attempted: {v}"
        );
        Ok(v)
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

/// Daemon `name`'s first JSON log line with `"event": event`, if any yet.
pub fn event(bed: &HostBed, name: &str, event: &str) -> Option<Value> {
    let text = std::fs::read_to_string(bed.log(name)).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == event)
}

/// The first JSON line of daemon `name`'s log with `"event": event`, waited for.
pub fn wait_event(bed: &HostBed, name: &str, ev: &str, timeout: Duration) -> anyhow::Result<Value> {
    Ok(wait_event_any(bed, &[name.to_string()], ev, timeout)?.1)
}

/// The first of `names` whose log has a JSON line with `"event": ev`, and that line.
pub fn wait_event_any(
    bed: &HostBed,
    names: &[String],
    ev: &str,
    timeout: Duration,
) -> anyhow::Result<(String, Value)> {
    let deadline = Instant::now() + timeout;
    loop {
        for name in names {
            if let Some(v) = event(bed, name, ev) {
                return Ok((name.clone(), v));
            }
        }
        if Instant::now() >= deadline {
            let tails: Vec<String> = names
                .iter()
                .map(|n| format!("--- {n}:\n{}", bed.tail(n, 40)))
                .collect();
            bail!(
                "no {ev} from {names:?} within {timeout:?}:\n{}",
                tails.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls the monitors' election until `want` leads; returns how long that took.
pub fn wait_leading(
    bed: &HostBed,
    store: &control::Store,
    rt: &tokio::runtime::Runtime,
    want: &str,
) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    loop {
        if rt
            .block_on(store.observe(&::failover::driver::store::election(VOL)))
            .ok()
            .flatten()
            .as_deref()
            == Some(want)
        {
            return Ok(t0.elapsed());
        }
        ensure!(
            t0.elapsed() < WAIT,
            "{want} does not lead within {WAIT:?}:\n{}",
            bed.tail(want, 30)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The host (`hI`) the leading monitor's status places instance `id` on.
pub fn host_of(status: &Value, id: &Value) -> anyhow::Result<String> {
    let insts = status["instances"]
        .as_array()
        .with_context(|| format!("no instances in {status}"))?;
    let i = insts
        .iter()
        .find(|i| &i["id"] == id)
        .with_context(|| format!("instance {id} not in {status}"))?;
    Ok(i["host"]
        .as_str()
        .with_context(|| format!("instance {id} has no host: {status}"))?
        .to_string())
}

/// `hI` → I.
pub fn host_index(host: &str) -> anyhow::Result<usize> {
    host.strip_prefix('h')
        .and_then(|i| i.parse().ok())
        .with_context(|| format!("{host} names no host"))
}

fn now_unix_ms() -> u64 {
    ::failover::proto::now_unix_ms()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Daemon `name`'s first JSON log line with `"event": ev` stamped at or after `since_unix_ms`.
fn event_since(bed: &HostBed, name: &str, ev: &str, since_unix_ms: u64) -> Option<Value> {
    let text = std::fs::read_to_string(bed.log(name)).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == ev && v["unix_ms"].as_u64().is_some_and(|t| t >= since_unix_ms))
}

/// What one loss of the primary's host showed (milliseconds since the host's death unless
/// named otherwise).
#[derive(Clone, Debug, serde::Serialize)]
pub struct HostLoss {
    pub with_monitor: bool,
    /// To the first commit acknowledged after the death: the promoted primary serving.
    pub serving_ms: u64,
    /// To the `promoted` event of the monitor that promoted (the failover decision carried out).
    pub promoted_ms: u64,
    /// To the standby's `leading` event (when the leading monitor died with the host).
    pub leading_ms: Option<u64>,
    /// The promoting monitor's own steps, each from the previous one's end (absent when its
    /// log lacks the event): the primary suspected, the super child made, the backup healthy,
    /// the collapse done (`promoted`).
    pub detect_ms: Option<u64>,
    pub super_ms: Option<u64>,
    pub start_ms: Option<u64>,
    pub collapse_ms: Option<u64>,
    pub acked: Value,
    pub max_gap_ms: Value,
    pub from: String,
    pub to: String,
    pub promoted_by: String,
    pub loadavg_at_kill: String,
    pub loadavg: String,
}

/// The scenario of the `failover_hosts` test and of the bench: the primary on host 0, the load
/// through an endpoint on host 1; host 0 killed (with the leading monitor when `with_monitor`,
/// else the leader is on host 1; a standby on host 2 either way); the backup promoted on a
/// surviving host; the endpoint re-pointed; nothing acknowledged lost. Call from the bed's
/// client thread.
pub fn lose_the_primarys_host(
    bed: &HostBed,
    with_monitor: bool,
    election_ttl: Duration,
) -> anyhow::Result<HostLoss> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut app = FailoverApp::start(bed, &rt)?;
    let _cleanup = Cleanup {
        bed,
        agent_dirs: app.agent_dirs.clone(),
    };
    let store = app.store(bed, &rt)?;
    // The primary goes to h0 (every agent live, none occupied: the first by name).
    let first = app.monitor(bed, if with_monitor { 0 } else { 1 }, election_ttl)?;
    wait_leading(bed, &store, &rt, &first)?;
    let standby = app.monitor(bed, 2, election_ttl)?;
    let ep = app.endpoint(bed, 1)?;
    app.endpoint(bed, 2)?;
    wait_event(bed, &first, "primary_up", WAIT)?;
    let st = app.wait_settled(bed, &first)?;
    let primary = st["state"]["primary"].clone();
    let lost = host_index(&host_of(&st, &primary)?)?;
    ensure!(lost == 0, "the primary goes to the first live host: {st}");
    wait_event(bed, &standby, "standing", WAIT)?;

    let load = Load::start(bed, ep)?;
    load.wait_acked(20, "before the host's death")?;
    let acked_at_kill = load.acked();
    let loadavg_at_kill = loadavg();
    let killed_unix_ms = now_unix_ms();
    let killed = Instant::now();
    bed.kill_host(lost)?;

    let leading_ms = if with_monitor {
        wait_leading(bed, &store, &rt, &standby)?;
        Some(
            wait_event(bed, &standby, "leading", WAIT)?["unix_ms"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(killed_unix_ms),
        )
    } else {
        None
    };
    // Whichever monitor leads promotes: the surviving leader may also lose its election lease
    // while etcd re-elects after losing a member, exit, and leave it to the standby.
    let survivors: Vec<String> = [first.clone(), standby.clone()]
        .into_iter()
        .filter(|m| !m.ends_with(&format!("h{lost}")))
        .collect();
    let (leader, promoted) = wait_event_any(bed, &survivors, "promoted", WAIT + WAIT)?;
    let serving = load.wait_acked(acked_at_kill + 1, "after the promotion")? - killed;
    load.wait_acked(load.acked() + 20, "after the promotion")?;
    let st = app.wait_settled(bed, &leader)?;
    ensure!(
        st["state"]["primary"] == promoted["instance"],
        "the promoted instance is not the primary: {st}"
    );
    let new_host = host_index(&host_of(&st, &promoted["instance"])?)?;
    ensure!(
        new_host != lost,
        "the promoted backup runs on the dead host: {st}"
    );
    // The endpoints follow the record the leader published: the promoted one, on its host.
    let rec = rt
        .block_on(::failover::driver::store::read_primary(&store, VOL))?
        .context("no primary record")?
        .0;
    ensure!(
        rec.instance.map(|i| i.0) == promoted["instance"].as_u64(),
        "the record names another instance: {rec:?}"
    );
    ensure!(
        rec.addr.map(|a| a.ip()) == Some(std::net::IpAddr::V4(bed.host(new_host).addr())),
        "the record names another host: {rec:?}"
    );
    let verdict = load.finish()?;

    let promoted_at = promoted["unix_ms"].as_u64().unwrap_or(0);
    let at = |ev: &str| {
        event_since(bed, &leader, ev, killed_unix_ms).and_then(|v| v["unix_ms"].as_u64())
    };
    let (suspected, superposed, healthy) =
        (at("suspected"), at("superposed"), at("backup_healthy"));
    let step = |from: Option<u64>, to: Option<u64>| Some(to?.saturating_sub(from?));
    Ok(HostLoss {
        with_monitor,
        serving_ms: serving.as_millis() as u64,
        promoted_ms: promoted_at.saturating_sub(killed_unix_ms),
        leading_ms,
        detect_ms: step(Some(killed_unix_ms), suspected),
        super_ms: step(suspected, superposed),
        start_ms: step(superposed, healthy),
        collapse_ms: step(healthy, Some(promoted_at)),
        acked: verdict["acked"].clone(),
        max_gap_ms: verdict["max_gap_ms"].clone(),
        from: format!("h{lost}"),
        to: format!("h{new_host}"),
        promoted_by: leader,
        loadavg_at_kill,
        loadavg: loadavg(),
    })
}
