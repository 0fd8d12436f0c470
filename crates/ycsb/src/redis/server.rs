//! A private `redis-server` process for tests and benchmarks.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Redis's `appendfsync`: when the append-only file is fsync'd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendFsync {
    /// After every write command (durable, slow).
    Always,
    /// Once a second (Redis's default).
    Everysec,
    /// Left to the kernel.
    No,
}

impl AppendFsync {
    pub fn as_str(self) -> &'static str {
        match self {
            AppendFsync::Always => "always",
            AppendFsync::Everysec => "everysec",
            AppendFsync::No => "no",
        }
    }
}

/// How to start the server.
#[derive(Clone, Debug)]
pub struct RedisServerOptions {
    /// The executable (Debian: `apt-get install redis-server`).
    pub binary: PathBuf,
    /// Keep an append-only file (`appendonly yes`); off, Redis keeps data in memory only.
    pub appendonly: bool,
    pub appendfsync: AppendFsync,
    /// Data directory; a fresh temporary directory (removed on drop) when `None`.
    pub dir: Option<PathBuf>,
    /// How long to wait for the server to answer `PING`.
    pub ready_timeout: Duration,
    /// More `--name value` arguments for redis-server (e.g. `--maxmemory 1gb`).
    pub extra_args: Vec<String>,
    /// Extra environment for the server process (e.g. `LD_PRELOAD` for a shim under test).
    pub env: Vec<(String, String)>,
}

impl Default for RedisServerOptions {
    fn default() -> Self {
        RedisServerOptions {
            binary: PathBuf::from("redis-server"),
            appendonly: false,
            appendfsync: AppendFsync::Everysec,
            dir: None,
            ready_timeout: Duration::from_secs(20),
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot start {binary}: {source} (install it: apt-get install redis-server)")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("redis-server did not become ready: {reason}; its log ends with:\n{log_tail}")]
    NotReady { reason: String, log_tail: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A running `redis-server` on 127.0.0.1 and a free port. Dropping it kills the process (by
/// pid, SIGKILL) and removes its temporary directory; it also dies with its parent.
pub struct RedisServer {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
}

/// Attempts at a free port: another process may take the port between our probe and Redis's
/// bind.
const START_ATTEMPTS: usize = 3;

fn free_port() -> std::io::Result<u16> {
    // Below the ephemeral range, which no outgoing connection takes meanwhile (wire::ports).
    wire::ports::free_loopback_port()
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

fn pong(addr: SocketAddr) -> bool {
    let attempt = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        s.write_all(b"*1\r\n$4\r\nPING\r\n")?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf)?;
        Ok(&buf == b"+PONG\r\n")
    };
    attempt().unwrap_or(false)
}

impl RedisServer {
    pub fn start(options: &RedisServerOptions) -> Result<RedisServer, ServerError> {
        let (temp, dir) = match &options.dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                (None, d.clone())
            }
            None => {
                let t = tempfile::Builder::new().prefix("ycsb-redis-").tempdir()?;
                let d = t.path().to_path_buf();
                (Some(t), d)
            }
        };
        let log = dir.join("redis.log");
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut command = Command::new(&options.binary);
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(&dir)
                .arg("--logfile")
                .arg(&log)
                .args(["--daemonize", "no", "--save", ""])
                .args([
                    "--appendonly",
                    if options.appendonly { "yes" } else { "no" },
                ])
                .args(["--appendfsync", options.appendfsync.as_str()])
                .args(&options.extra_args)
                .envs(options.env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let parent = std::process::id() as libc::pid_t;
            // SAFETY: only async-signal-safe calls (prctl, getppid, kill) between fork and exec.
            unsafe {
                command.pre_exec(move || {
                    libc::prctl(
                        libc::PR_SET_PDEATHSIG,
                        libc::SIGKILL as libc::c_ulong,
                        0,
                        0,
                        0,
                    );
                    if libc::getppid() != parent {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                    Ok(())
                });
            }
            let mut child = command.spawn().map_err(|source| ServerError::Spawn {
                binary: options.binary.display().to_string(),
                source,
            })?;
            let deadline = Instant::now() + options.ready_timeout;
            let outcome = loop {
                if let Ok(Some(status)) = child.try_wait() {
                    break Err(format!("it exited ({status})"));
                }
                if pong(addr) {
                    break Ok(());
                }
                if Instant::now() >= deadline {
                    break Err(format!(
                        "no PONG within {} ms",
                        options.ready_timeout.as_millis()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(pid = child.id(), %addr, dir = %dir.display(), "redis-server started");
                    return Ok(RedisServer {
                        child,
                        addr,
                        dir,
                        _temp: temp,
                    });
                }
                Err(reason) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let tail = log_tail(&log);
                    let port_taken = tail.contains("Address already in use");
                    last_error = Some(ServerError::NotReady {
                        reason,
                        log_tail: tail,
                    });
                    if !port_taken {
                        break;
                    }
                }
            }
        }
        Err(last_error.expect("at least one attempt was made"))
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills the server now (SIGKILL by pid) and reaps it.
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
