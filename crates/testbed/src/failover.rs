//! The failover monitor as a child process (`understudy failover run SPEC`), started and stopped
//! by PID, and a client of its control address: used by the failover benchmarks, the demo and
//! `understudy failover inject|status|hint`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use anyhow::Context;

/// The monitor process of a run: stopped on every path out of it (SIGTERM: it stops its
/// instances cleanly), then whatever it left is cleaned up — a monitor that crashed or hung
/// leaves processes, network namespaces, mounts and loop devices: its namespaces (by its tag)
/// are destroyed with everything in them, and every mount point under `state_dir/mnt` is
/// detached (`volume detach` unmounts, frees the loop device and the FUSE file).
pub struct MonitorGuard {
    child: std::process::Child,
    state_dir: PathBuf,
    cluster_file: PathBuf,
}

impl MonitorGuard {
    pub fn new(child: std::process::Child, state_dir: &Path, cluster_file: &Path) -> MonitorGuard {
        MonitorGuard { child, state_dir: state_dir.to_path_buf(), cluster_file: cluster_file.to_path_buf() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for MonitorGuard {
    fn drop(&mut self) {
        crate::proc::signal(self.child.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(60);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Ok(tag) = std::fs::read_to_string(self.state_dir.join("netns.tag")) {
            let gone = ::failover::netns::destroy_all(tag.trim());
            if !gone.is_empty() {
                eprintln!("failover bench: removed network namespaces left behind: {gone:?}");
            }
        }
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("understudy"));
        if let Ok(dirs) = std::fs::read_dir(self.state_dir.join("mnt")) {
            for d in dirs.flatten() {
                let o = Command::new(&exe).args(["volume", "detach"]).arg(d.path()).arg("--cluster").arg(&self.cluster_file).stdin(Stdio::null()).output();
                if let Ok(o) = o {
                    if o.status.success() {
                        eprintln!("failover bench: detached {} left behind", d.path().display());
                    }
                }
            }
        }
    }
}

/// Starts `understudy failover run SPEC` as a child process (stderr to `run_dir/monitor.err`) and
/// returns its guard and the stream of its JSON event lines.
pub fn start_monitor(
    exe: &Path,
    spec_path: &Path,
    run_dir: &Path,
    control: &str,
    cluster_file: &Path,
    verbose: u8,
) -> anyhow::Result<(MonitorGuard, Receiver<serde_json::Value>)> {
    let mut cmd = Command::new(exe);
    cmd.args(["failover", "run"]).arg(spec_path).args(["--control", control, "--cluster"]).arg(cluster_file);
    if verbose > 0 {
        cmd.arg(format!("-{}", "v".repeat(verbose as usize)));
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(run_dir.join("monitor.err"))?))
        .spawn()
        .context("cannot start `understudy failover run`")?;
    let out = child.stdout.take().context("the monitor's stdout")?;
    let guard = MonitorGuard::new(child, &run_dir.join("state"), cluster_file);
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    Ok((guard, rx))
}

/// The last lines of a run's logs (the monitor's and its instances'), for an error report: a
/// failed run is otherwise hard to diagnose once its directory is gone.
pub fn logs_tail(run_dir: &Path) -> String {
    const TAIL_LINES: usize = 15;
    let mut files = vec![run_dir.join("monitor.err")];
    if let Ok(rd) = std::fs::read_dir(run_dir.join("state").join("logs")) {
        let mut logs: Vec<_> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        logs.sort();
        files.extend(logs);
    }
    let mut out = String::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(TAIL_LINES)..];
        out.push_str(&format!("\n--- {} (last {} lines)\n{}", f.display(), tail.len(), tail.join("\n")));
    }
    out
}

/// Sends one line to a running monitor's control address, after proving it knows the cluster
/// `secret` (the port's handshake, [`wire::auth`]), over TLS when this process's cluster-link
/// setting asks for it ([`wire::link::process`], as the monitor's does), and returns its `ok`
/// answer (an `error` answer becomes the error). Callable from any thread, a runtime's too: the
/// exchange runs on a thread of its own.
pub fn control_request(addr: SocketAddr, secret: &[u8], line: &str) -> anyhow::Result<String> {
    let tls = wire::link::process()?;
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(control_exchange(addr, tls, secret, line))
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

async fn control_exchange(addr: SocketAddr, tls: Option<&wire::link::LinkTls>, secret: &[u8], line: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let sock = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow::anyhow!("no connection within 5 s"))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(|| format!("cannot reach the monitor's control address {addr}"))?;
    let mut link = wire::link::connect(sock, tls).await.with_context(|| format!("the control address {addr}"))?;
    let refused = || {
        format!("the monitor at {addr} refused us: wrong cluster secret, or TLS on one side only? (check --secret-file or the cluster file, and {})", wire::link::LINK_TLS_ENV)
    };
    tokio::time::timeout(Duration::from_secs(60), wire::auth::connect(&mut link, secret))
        .await
        .map_err(|_| anyhow::anyhow!("no handshake within 60 s (not a monitor's --control?)"))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(refused)?;
    link.write_all(format!("{line}\n").as_bytes()).await?;
    link.flush().await?;
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(60), tokio::io::BufReader::new(link).read_line(&mut reply))
        .await
        .map_err(|_| anyhow::anyhow!("no answer from the monitor at {addr} within 60 s"))??;
    let reply = reply.trim_end();
    match reply.split_once(' ') {
        Some(("ok", rest)) => Ok(rest.to_string()),
        Some(("error", e)) => anyhow::bail!("{e}"),
        _ => anyhow::bail!("unexpected answer from the monitor: {reply:?}"),
    }
}
