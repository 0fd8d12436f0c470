//! A real etcd cluster (Debian's `etcd-server`, `/usr/bin/etcd`) of N members as processes: own
//! data directories in a temporary directory, ports from [`wire::ports`], short heartbeat and
//! election timeouts so tests see failovers in well under a second. Members can be killed
//! (SIGKILL), stopped (SIGTERM) and restarted on their data; everything is killed and removed on
//! drop.
//!
//! Each member runs at a [`MemberPlace`]: the address it listens on and advertises, and the
//! [`Place`] that starts its process and reaches its port. [`EtcdCluster::start`] puts every
//! member on 127.0.0.1 of this machine; [`EtcdCluster::start_with`] takes the places, e.g. one
//! host of a [`crate::hosts::Hosts`] bed per member (`MemberPlace::from(bed.host(i))`), so
//! losing or cutting off a host loses or cuts off its member. Everything the cluster does to a
//! member (start, health probe, `etcdctl`) goes through the member's place, so a member in a
//! network namespace is managed exactly as one on loopback.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// The etcd server binary.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// The etcd client (v3 API).
pub const ETCDCTL_BIN: &str = "/usr/bin/etcdctl";
/// Deadline of one [`EtcdCluster::etcdctl`] run (its own dial and command timeouts are 1 s and
/// 2 s; this is the backstop against a hung client).
pub const ETCDCTL_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a health probe may take to connect to a member.
pub const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Raft heartbeat for test clusters (etcd's default is 100 ms).
pub const HEARTBEAT_MS: u64 = 50;
/// Raft election timeout for test clusters (etcd's default is 1000 ms); generous against a loaded
/// 2-core machine's scheduling stalls, short enough for quick failovers.
pub const ELECTION_TIMEOUT_MS: u64 = 500;
/// How long a started or restarted cluster may take to become healthy.
pub const HEALTHY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a member's processes run and from where its ports are reached: this machine, or a
/// host of a test bed ([`crate::hosts::HostPlace`]).
pub trait Place: Send + Sync {
    /// A command that runs `program` there (the caller adds arguments, stdio, process group).
    fn command(&self, program: &OsStr) -> Command;
    /// A TCP connection to `to` opened from there (usable from any thread afterwards).
    fn connect(&self, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream>;
}

/// The machine (and network namespace) the test runs in.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThisMachine;

impl Place for ThisMachine {
    fn command(&self, program: &OsStr) -> Command {
        Command::new(program)
    }
    fn connect(&self, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        TcpStream::connect_timeout(&to, timeout)
    }
}

/// One member's place: the address it listens on and advertises, and where it runs.
#[derive(Clone)]
pub struct MemberPlace {
    pub addr: String,
    pub place: Arc<dyn Place>,
}

impl MemberPlace {
    pub fn new(addr: impl Into<String>, place: Arc<dyn Place>) -> MemberPlace {
        MemberPlace { addr: addr.into(), place }
    }

    /// A member on this machine at `addr`.
    pub fn local(addr: impl Into<String>) -> MemberPlace {
        MemberPlace::new(addr, Arc::new(ThisMachine))
    }
}

struct Member {
    name: String,
    host: String,
    place: Arc<dyn Place>,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn client(&self) -> String {
        format!("{}:{}", self.host, self.client_port)
    }
    fn peer_url(&self) -> String {
        format!("http://{}:{}", self.host, self.peer_port)
    }
    fn healthy(&self) -> bool {
        healthy_via(self.place.as_ref(), &self.client())
    }
}

/// A running etcd cluster; dropping it kills every member and removes its directory.
pub struct EtcdCluster {
    dir: PathBuf,
    token: String,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// Starts `n` members on 127.0.0.1 and waits until every one is healthy.
    pub fn start(n: usize) -> anyhow::Result<EtcdCluster> {
        EtcdCluster::start_on(&vec!["127.0.0.1".to_string(); n])
    }

    /// Starts one member on this machine per entry of `hosts` (the address it listens on and
    /// advertises) and waits until every one is healthy.
    pub fn start_on(hosts: &[String]) -> anyhow::Result<EtcdCluster> {
        EtcdCluster::start_with(hosts.iter().map(MemberPlace::local).collect())
    }

    /// Starts one member per place (member `i` at `places[i]`) and waits until every one is
    /// healthy. Ports come from [`wire::ports`] even where the address is a namespace's own:
    /// free on loopback is free in a fresh namespace too, and one allocator keeps it simple.
    pub fn start_with(places: Vec<MemberPlace>) -> anyhow::Result<EtcdCluster> {
        anyhow::ensure!(Path::new(ETCD_BIN).exists(), "{ETCD_BIN} is missing: install Debian's etcd-server (scripts/install-deps)");
        anyhow::ensure!(!places.is_empty(), "an etcd cluster needs at least one member");
        let token = format!("understudy-test-{}-{:x}", std::process::id(), rand::random::<u32>());
        let dir = std::env::temp_dir().join(&token);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
        let ports = wire::ports::free_loopback_ports(2 * places.len())?;
        let members = places
            .iter()
            .enumerate()
            .map(|(i, p)| Member {
                name: format!("m{i}"),
                host: p.addr.clone(),
                place: p.place.clone(),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                data: dir.join(format!("m{i}.etcd")),
                log: dir.join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let mut cluster = EtcdCluster { dir, token, members };
        for i in 0..cluster.members.len() {
            cluster.spawn(i)?;
        }
        cluster.wait_healthy(HEALTHY_TIMEOUT)?;
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let initial: Vec<String> = self.members.iter().map(|m| format!("{}={}", m.name, m.peer_url())).collect();
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&m.log)?;
        let mut cmd = m.place.command(OsStr::new(ETCD_BIN));
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data)
            .arg("--listen-client-urls")
            .arg(format!("http://{}", m.client()))
            .arg("--advertise-client-urls")
            .arg(format!("http://{}", m.client()))
            .arg("--listen-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--heartbeat-interval")
            .arg(HEARTBEAT_MS.to_string())
            .arg("--election-timeout")
            .arg(ELECTION_TIMEOUT_MS.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
        crate::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        let child = cmd.spawn().with_context(|| format!("cannot start {ETCD_BIN}"))?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// `etcd://h1:p1,h2:p2,...`: the store address of the whole cluster.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// Every member's client address (`host:port`).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client).collect()
    }

    /// Member `i`'s client address.
    pub fn endpoint(&self, i: usize) -> String {
        self.members[i].client()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s pid while it runs (or, killed from outside, until it is restarted).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Member `i`'s log file.
    pub fn log(&self, i: usize) -> &Path {
        &self.members[i].log
    }

    /// SIGKILLs member `i` and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERMs member `i` and waits for it (SIGKILL after [`crate::proc::STOP_GRACE`]).
    pub fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            crate::proc::signal(c.id(), libc::SIGTERM);
            let deadline = Instant::now() + crate::proc::STOP_GRACE;
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data directory (it rejoins the cluster it was in) and
    /// waits until it reports healthy, which needs a quorum of members running.
    ///
    /// A member killed from outside (its host lost) is reaped first; one still running is an
    /// error.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(c) = self.members[i].child.as_mut() {
            anyhow::ensure!(matches!(c.try_wait(), Ok(Some(_))), "member {i} is running");
            self.members[i].child = None;
        }
        self.spawn(i)?;
        let deadline = Instant::now() + HEALTHY_TIMEOUT;
        while !self.members[i].healthy() {
            anyhow::ensure!(Instant::now() < deadline, "etcd member {i} not healthy within {:?} after restart: {}", HEALTHY_TIMEOUT, crate::proc::tail(&self.members[i].log, 10));
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits until every running member reports healthy (`GET /health`: it has a leader and can
    /// commit).
    pub fn wait_healthy(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        for i in 0..self.members.len() {
            loop {
                let m = &mut self.members[i];
                let Some(child) = m.child.as_mut() else { break };
                if let Ok(Some(status)) = child.try_wait() {
                    anyhow::bail!("etcd member {i} exited ({status}): {}", crate::proc::tail(&m.log, 10));
                }
                if m.healthy() {
                    break;
                }
                anyhow::ensure!(Instant::now() < deadline, "etcd member {i} not healthy within {timeout:?}: {}", crate::proc::tail(&m.log, 10));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// `etcdctl ARGS` (v3 API) run at member `on`'s place against the members `members`;
    /// its stdout, or an error with its exit status and stderr. Each call is one short-lived
    /// client (1 s dial, 2 s command timeout), as an operator's would be.
    pub fn etcdctl(&self, on: usize, members: &[usize], args: &[&str]) -> anyhow::Result<String> {
        let eps: Vec<String> = members.iter().map(|j| format!("http://{}", self.members[*j].client())).collect();
        let mut c = self.members[on].place.command(OsStr::new(ETCDCTL_BIN));
        c.env("ETCDCTL_API", "3").arg(format!("--endpoints={}", eps.join(","))).args(["--dial-timeout=1s", "--command-timeout=2s"]).args(args);
        let o = crate::proc::output_bounded(&mut c, ETCDCTL_TIMEOUT)?;
        anyhow::ensure!(o.status.success(), "etcdctl {}: {}: {}", args.join(" "), crate::proc::describe_status(o.status), String::from_utf8_lossy(&o.stderr).trim());
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// The member that leads, if every one of `members` answers (asked from member `on`'s
    /// place) and they all name the same leader, which is one of them. None while an election
    /// runs, or when a member does not answer or knows another leader.
    pub fn leader(&self, on: usize, members: &[usize]) -> Option<usize> {
        let out = self.etcdctl(on, members, &["endpoint", "status", "-w", "json"]).ok()?;
        leader_of(&out, &members.iter().map(|j| (*j, format!("http://{}", self.members[*j].client()))).collect::<Vec<_>>())
    }
}

/// The member that `etcdctl endpoint status -w json` output `status` names as the leader of
/// all of `members` (index, endpoint URL), if they all answered and agree.
fn leader_of(status: &str, members: &[(usize, String)]) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_str(status).ok()?;
    let statuses = v.as_array()?;
    if statuses.len() != members.len() {
        return None;
    }
    let mut leaders = statuses.iter().map(|s| s["Status"]["leader"].as_u64());
    let l = leaders.next()??;
    // 0 is "no leader" in etcd's raft.
    if l == 0 || !leaders.all(|x| x == Some(l)) {
        return None;
    }
    let s = statuses.iter().find(|s| s["Status"]["header"]["member_id"].as_u64() == Some(l))?;
    let ep = s["Endpoint"].as_str()?;
    members.iter().find(|(_, url)| url == ep).map(|(j, _)| *j)
}

/// Whether the member at `client` (`host:port`, on this machine) answers `GET /health` with
/// health true.
pub fn healthy(client: &str) -> bool {
    healthy_via(&ThisMachine, client)
}

/// [`healthy`], asked from `place`.
fn healthy_via(place: &dyn Place, client: &str) -> bool {
    let ask = || -> std::io::Result<String> {
        let addr = client.parse().map_err(std::io::Error::other)?;
        let mut s = place.connect(addr, PROBE_CONNECT_TIMEOUT)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(format!("GET /health HTTP/1.1\r\nHost: {client}\r\nConnection: close\r\n\r\n").as_bytes())?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    };
    ask().map(|a| a.contains("\"health\":\"true\"")).unwrap_or(false)
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Vec<(usize, String)> {
        vec![(0, "http://10.0.0.1:2379".into()), (2, "http://10.0.0.3:2379".into())]
    }

    fn status(ep: &str, id: u64, leader: u64) -> String {
        format!(r#"{{"Endpoint":"{ep}","Status":{{"header":{{"member_id":{id}}},"leader":{leader}}}}}"#)
    }

    #[test]
    fn the_leader_is_the_member_all_agree_on() {
        let both = |l0, l2| format!("[{},{}]", status("http://10.0.0.1:2379", 11, l0), status("http://10.0.0.3:2379", 33, l2));
        assert_eq!(leader_of(&both(33, 33), &members()), Some(2));
        assert_eq!(leader_of(&both(11, 11), &members()), Some(0));
        // Disagreement (an election under way, a partitioned member's stale view): none.
        assert_eq!(leader_of(&both(11, 33), &members()), None);
        assert_eq!(leader_of(&both(0, 0), &members()), None, "0 is no leader");
        // A leader outside the members asked: none.
        assert_eq!(leader_of(&both(99, 99), &members()), None);
        // A member did not answer: none.
        assert_eq!(leader_of(&format!("[{}]", status("http://10.0.0.3:2379", 33, 33)), &members()), None);
        assert_eq!(leader_of("not json", &members()), None);
    }
}
