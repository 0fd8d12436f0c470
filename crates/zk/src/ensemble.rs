//! A real ZooKeeper ensemble on loopback: N `QuorumPeerMain` JVMs from Debian's `zookeeper`
//! package, each with a generated `zoo.cfg`, `myid` and data directory under one private
//! directory. Every JVM gets SIGKILL as its parent-death signal and is killed when the
//! [`Ensemble`] is dropped, so none outlives the benchmark, even on a panic.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::fourlw::{srvr, ServerState};
use crate::ZkError;

/// Debian's ZooKeeper server jar (its manifest names the other jars).
pub const DEBIAN_ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// An SLF4J binding that logs to stderr (without one, ZooKeeper logs nothing).
pub const DEBIAN_SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";
/// How to get them.
pub const INSTALL_HINT: &str =
    "install Debian's ZooKeeper: apt-get install zookeeper (it pulls a Java runtime)";

/// How to run the ensemble.
#[derive(Clone, Debug)]
pub struct EnsembleOptions {
    /// Servers (3 for a majority that survives one failure).
    pub servers: usize,
    /// Private directory: `DIR/zk-ID/{zoo.cfg,data/,server.log}`.
    pub dir: PathBuf,
    /// The `java` executable (looked up in PATH if it has no slash).
    pub java: PathBuf,
    /// Class path of the server.
    pub classpath: String,
    /// ZooKeeper's time unit; limits below are in ticks.
    pub tick_time_ms: u32,
    /// Ticks a follower has to connect to and sync with the leader.
    pub init_limit_ticks: u32,
    /// Ticks a follower may lag the leader before it is dropped.
    pub sync_limit_ticks: u32,
    /// Maximum Java heap per server.
    pub heap_mib: u32,
}

impl EnsembleOptions {
    /// Three servers with Debian's jars, a 500 ms tick, and a 256 MiB heap each.
    pub fn new(dir: PathBuf) -> Self {
        let mut classpath = DEBIAN_ZOOKEEPER_JAR.to_string();
        if Path::new(DEBIAN_SLF4J_SIMPLE_JAR).exists() {
            classpath.push(':');
            classpath.push_str(DEBIAN_SLF4J_SIMPLE_JAR);
        }
        EnsembleOptions {
            servers: 3,
            dir,
            java: PathBuf::from("java"),
            classpath,
            tick_time_ms: 500,
            init_limit_ticks: 60,
            sync_limit_ticks: 6,
            heap_mib: 256,
        }
    }
}

/// One server of the ensemble.
#[derive(Debug)]
pub struct Server {
    /// ZooKeeper's `myid` (1-based).
    pub id: usize,
    pub client_addr: SocketAddr,
    pub dir: PathBuf,
    child: Option<Child>,
}

/// The running ensemble.
#[derive(Debug)]
pub struct Ensemble {
    opts: EnsembleOptions,
    java: PathBuf,
    servers: Vec<Server>,
}

/// Finds an executable: a path with a slash as is, else the first match in PATH.
fn which(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(program))
                .find(|c| c.is_file())
        })
        .unwrap_or(None)
}

fn free_ports(n: usize) -> Result<Vec<u16>, ZkError> {
    // Distinct, and below the ephemeral range, which no outgoing connection takes between this
    // pick and the servers' bind (wire::ports).
    Ok(wire::ports::free_loopback_ports(n)?)
}

impl Ensemble {
    /// Writes every server's configuration and starts them all. Fails with a clear message if
    /// Java or ZooKeeper is missing. Call [`Ensemble::wait_ready`] before using it.
    pub fn start(opts: EnsembleOptions) -> Result<Ensemble, ZkError> {
        if !(1..=9).contains(&opts.servers) {
            return Err(ZkError::BadArgument(format!(
                "{} servers: 1 to 9 are supported",
                opts.servers
            )));
        }
        let java = which(&opts.java).ok_or_else(|| {
            ZkError::Setup(format!("{} not found; {INSTALL_HINT}", opts.java.display()))
        })?;
        for jar in opts.classpath.split(':').filter(|j| !j.is_empty()) {
            if !Path::new(jar).exists() {
                return Err(ZkError::Setup(format!("{jar} not found; {INSTALL_HINT}")));
            }
        }
        let ports = free_ports(3 * opts.servers)?;
        let peers: String = (0..opts.servers)
            .map(|i| {
                format!(
                    "server.{}=127.0.0.1:{}:{}\n",
                    i + 1,
                    ports[3 * i + 1],
                    ports[3 * i + 2]
                )
            })
            .collect();
        let mut servers = Vec::new();
        for i in 0..opts.servers {
            let id = i + 1;
            let dir = opts.dir.join(format!("zk-{id}"));
            std::fs::create_dir_all(dir.join("data"))?;
            std::fs::write(dir.join("data/myid"), format!("{id}\n"))?;
            let cfg = format!(
                "# Generated by understudy for a local benchmark ensemble.\n\
                 tickTime={tick}\ninitLimit={init}\nsyncLimit={sync}\n\
                 dataDir={data}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=srvr,mntr,ruok,stat\n\
                 maxClientCnxns=0\nautopurge.purgeInterval=0\n{peers}",
                tick = opts.tick_time_ms,
                init = opts.init_limit_ticks,
                sync = opts.sync_limit_ticks,
                data = dir.join("data").display(),
                port = ports[3 * i],
            );
            std::fs::write(dir.join("zoo.cfg"), cfg)?;
            servers.push(Server {
                id,
                client_addr: SocketAddr::from(([127, 0, 0, 1], ports[3 * i])),
                dir,
                child: None,
            });
        }
        let mut e = Ensemble {
            opts,
            java,
            servers,
        };
        for i in 0..e.servers.len() {
            e.spawn(i)?;
        }
        Ok(e)
    }

    fn spawn(&mut self, i: usize) -> Result<(), ZkError> {
        let s = &self.servers[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(s.dir.join("server.log"))?;
        let mut cmd = Command::new(&self.java);
        cmd.arg(format!("-Xmx{}m", self.opts.heap_mib))
            .args([
                "-XX:+UseSerialGC",
                "-Djava.awt.headless=true",
                "-Dorg.slf4j.simpleLogger.showDateTime=true",
            ])
            .arg(format!("-Dzookeeper.log.dir={}", s.dir.display()))
            .args([
                "-cp",
                &self.opts.classpath,
                "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            ])
            .arg(s.dir.join("zoo.cfg"))
            .current_dir(&s.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
        // SAFETY: only async-signal-safe calls (setpgid, prctl) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                );
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| ZkError::Setup(format!("cannot start {}: {e}", self.java.display())))?;
        tracing::info!(server = s.id, pid = child.id(), addr = %s.client_addr, "zookeeper server started");
        self.servers[i].child = Some(child);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    pub fn server(&self, i: usize) -> &Server {
        &self.servers[i]
    }

    pub fn client_addr(&self, i: usize) -> SocketAddr {
        self.servers[i].client_addr
    }

    pub fn log_path(&self, i: usize) -> PathBuf {
        self.servers[i].dir.join("server.log")
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.servers[i].child.as_ref().map(|c| c.id())
    }

    /// Waits until every server serves and one is the leader; returns the leader's index.
    /// A server that exited fails the wait at once, naming its log.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<usize, ZkError> {
        let start = Instant::now();
        loop {
            let mut leader = None;
            let mut serving = 0;
            for i in 0..self.servers.len() {
                if let Some(c) = &mut self.servers[i].child {
                    if let Ok(Some(st)) = c.try_wait() {
                        return Err(ZkError::Setup(format!(
                            "zookeeper server {} exited ({st}); see {}",
                            self.servers[i].id,
                            self.log_path(i).display()
                        )));
                    }
                }
                if let Ok(ServerState::Serving { mode, .. }) =
                    srvr(self.client_addr(i), Duration::from_secs(2)).await
                {
                    serving += 1;
                    if mode == "leader" || mode == "standalone" {
                        leader = Some(i);
                    }
                }
            }
            if let (Some(l), true) = (leader, serving == self.servers.len()) {
                return Ok(l);
            }
            if start.elapsed() > timeout {
                return Err(ZkError::Setup(format!(
                    "the ensemble did not form within {timeout:?} ({serving} of {} serving); see {}/zk-*/server.log",
                    self.servers.len(),
                    self.opts.dir.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills server `i` with SIGKILL and reaps it (its durable state stays).
    pub fn kill(&mut self, i: usize) -> Result<(), ZkError> {
        if let Some(mut c) = self.servers[i].child.take() {
            let _ = c.kill();
            c.wait()?;
        }
        Ok(())
    }

    /// Starts server `i` again on its data directory (no-op if it runs).
    pub fn restart(&mut self, i: usize) -> Result<(), ZkError> {
        if let Some(c) = &mut self.servers[i].child {
            if let Ok(None) = c.try_wait() {
                return Ok(());
            }
        }
        self.spawn(i)
    }

    /// Sends `signal` (e.g. SIGSTOP, SIGCONT) to server `i`.
    pub fn signal(&self, i: usize, signal: libc::c_int) -> Result<(), ZkError> {
        let pid = self
            .pid(i)
            .ok_or_else(|| ZkError::Setup(format!("server {} is not running", i + 1)))?;
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is our unreaped child.
        if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }
}

impl Drop for Ensemble {
    fn drop(&mut self) {
        for s in &mut self.servers {
            if let Some(mut c) = s.child.take() {
                // SIGKILL also ends a stopped (SIGSTOP) process.
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
