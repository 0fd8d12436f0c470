//! A real etcd cluster (Debian's `etcd-server`, `/usr/bin/etcd`) of N members as processes: own
//! data directories in a temporary directory, ports from [`wire::ports`], short heartbeat and
//! election timeouts so tests see failovers in well under a second. Members can be killed
//! (SIGKILL), stopped (SIGTERM) and restarted on their data; everything is killed and removed on
//! drop.
//!
//! Each member listens on the host its caller names ([`EtcdCluster::start_on`]), so a test bed of
//! network namespaces can give each "machine" its own address; [`EtcdCluster::start`] puts every
//! member on 127.0.0.1.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// The etcd server binary.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// Raft heartbeat for test clusters (etcd's default is 100 ms).
pub const HEARTBEAT_MS: u64 = 50;
/// Raft election timeout for test clusters (etcd's default is 1000 ms); generous against a loaded
/// 2-core machine's scheduling stalls, short enough for quick failovers.
pub const ELECTION_TIMEOUT_MS: u64 = 500;
/// How long a started or restarted cluster may take to become healthy.
pub const HEALTHY_TIMEOUT: Duration = Duration::from_secs(30);

struct Member {
    name: String,
    host: String,
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

    /// Starts one member per entry of `hosts` (the address it listens on and advertises) and
    /// waits until every one is healthy.
    pub fn start_on(hosts: &[String]) -> anyhow::Result<EtcdCluster> {
        anyhow::ensure!(Path::new(ETCD_BIN).exists(), "{ETCD_BIN} is missing: install Debian's etcd-server (scripts/install-deps)");
        anyhow::ensure!(!hosts.is_empty(), "an etcd cluster needs at least one member");
        let token = format!("understudy-test-{}-{:x}", std::process::id(), rand::random::<u32>());
        let dir = std::env::temp_dir().join(&token);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
        let ports = wire::ports::free_loopback_ports(2 * hosts.len())?;
        let members = hosts
            .iter()
            .enumerate()
            .map(|(i, host)| Member {
                name: format!("m{i}"),
                host: host.clone(),
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
        let mut cmd = Command::new(ETCD_BIN);
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

    /// Member `i`'s pid while it runs.
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
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        anyhow::ensure!(self.members[i].child.is_none(), "member {i} is running");
        self.spawn(i)?;
        let deadline = Instant::now() + HEALTHY_TIMEOUT;
        while !healthy(&self.members[i].client()) {
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
                if healthy(&m.client()) {
                    break;
                }
                anyhow::ensure!(Instant::now() < deadline, "etcd member {i} not healthy within {timeout:?}: {}", crate::proc::tail(&m.log, 10));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }
}

/// Whether the member at `client` (`host:port`) answers `GET /health` with health true.
pub fn healthy(client: &str) -> bool {
    let ask = || -> std::io::Result<String> {
        let addr = client.parse().map_err(std::io::Error::other)?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
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
