//! Shared helpers of the CLI integration tests: a local cluster started with `understudy up` on
//! free ports in a temporary directory, the CLI run against it, and qemu-io as the NBD client.
//! Every process a test starts is stopped by pid when its guard is dropped, even on failure.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use testbed::proc::{alive, signal};

pub const BIN: &str = env!("CARGO_BIN_EXE_understudy");
const UP_TIMEOUT: Duration = Duration::from_secs(120);

pub fn require_qemu() {
    let ok = Command::new("qemu-io").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
    assert!(ok, "these tests need qemu-io and qemu-img: apt-get install qemu-utils");
}

/// A live (not zombie) `understudy` process.
fn is_understudy(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    alive(pid) && String::from_utf8_lossy(&cmdline).contains("understudy")
}

/// Stops a child: SIGTERM, up to `grace`, then SIGKILL; always reaps it.
pub fn stop_child(c: &mut Child, grace: Duration) {
    if let Ok(None) = c.try_wait() {
        signal(c.id(), libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
    }
    let _ = c.wait();
}

/// A cluster started by `understudy up`, plus any process the test started beside it.
pub struct Up {
    pub dir: tempfile::TempDir,
    up: Option<Child>,
    pub info: serde_json::Value,
    extra: Vec<Child>,
    /// Extra `up` arguments, passed again by [`Up::restart`].
    up_args: Vec<String>,
}

impl Up {
    pub fn start(shards: u32) -> Up {
        Up::start_with(shards, &[])
    }

    /// As [`Up::start`], with extra `up` arguments (`--restart-after-ms 0` for a test that
    /// restarts or replaces daemons itself).
    pub fn start_with(shards: u32, up_args: &[&str]) -> Up {
        let dir = tempfile::Builder::new().prefix("understudy-test-").tempdir().unwrap();
        let out = std::fs::File::create(dir.path().join("up.out")).unwrap();
        let child = Command::new(BIN)
            .args(["up", "--dir"])
            .arg(dir.path())
            .args(["--port-base", "0", "--shards", &shards.to_string()])
            .args(up_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("cannot start understudy up");
        let up_args = up_args.iter().map(|a| a.to_string()).collect();
        let mut up = Up { dir, up: Some(child), info: serde_json::Value::Null, extra: vec![], up_args };
        up.wait_cluster_file(None);
        up
    }

    /// Stops `understudy up` (SIGTERM) and starts it again on the same directory, which reuses
    /// the data, the secret and the settings; waits for the new cluster file.
    pub fn restart(&mut self) {
        if let Some(mut up) = self.up.take() {
            stop_child(&mut up, Duration::from_secs(20));
        }
        let out = std::fs::OpenOptions::new().append(true).open(self.dir.path().join("up.out")).unwrap();
        let child = Command::new(BIN)
            .args(["up", "--dir"])
            .arg(self.dir.path())
            .args(&self.up_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("cannot start understudy up");
        let new_pid = child.id() as u64;
        self.up = Some(child);
        self.wait_cluster_file(Some(new_pid));
    }

    fn wait_cluster_file(&mut self, up_pid: Option<u64>) {
        let file = self.cluster_file();
        let deadline = Instant::now() + UP_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.up.as_mut().unwrap().try_wait() {
                panic!("understudy up exited ({status}):\n{}", self.up_output());
            }
            if let Ok(bytes) = std::fs::read(&file) {
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
                    if up_pid.is_none_or(|p| v["up_pid"].as_u64() == Some(p)) {
                        self.info = v;
                        return;
                    }
                }
            }
            assert!(Instant::now() < deadline, "cluster not up within {UP_TIMEOUT:?}:\n{}", self.up_output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn up_output(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("up.out")).unwrap_or_default()
    }

    pub fn cluster_file(&self) -> PathBuf {
        self.dir.path().join("cluster.json")
    }

    pub fn secret_file(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    pub fn meta_addr(&self) -> String {
        self.info["meta"]["addr"].as_str().unwrap().to_string()
    }

    pub fn uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.info["nbd"]["addr"].as_str().unwrap())
    }

    pub fn shard(&self, id: u32) -> &serde_json::Value {
        self.info["shards"].as_array().unwrap().iter().find(|s| s["id"] == id).expect("no such shard")
    }

    pub fn shard_pid(&self, id: u32) -> u32 {
        self.shard(id)["pid"].as_u64().unwrap() as u32
    }

    /// `understudy ARGS --cluster <this cluster>`.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN).args(args).arg("--cluster").arg(self.cluster_file()).stdin(Stdio::null()).output().unwrap()
    }

    /// Runs the CLI and expects success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(
            o.status.success(),
            "`understudy {}` failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    /// Runs the CLI and expects a failure with a one-line error; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        expect_one_line_error(&o, &args.join(" "))
    }

    /// Shard states from `status --json`: (id, state).
    pub fn shard_states(&self) -> Vec<(u32, String)> {
        let v: serde_json::Value = serde_json::from_str(&self.ok(&["status", "--json"])).unwrap();
        v["map"]["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["id"].as_u64().unwrap() as u32, s["state"].as_str().unwrap().to_string()))
            .collect()
    }

    /// Waits until shard `id` is in `state` ("Up", "Down", "Recovering").
    pub fn wait_shard(&self, id: u32, state: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let states = self.shard_states();
            if states.iter().any(|(i, s)| *i == id && s == state) {
                return;
            }
            assert!(Instant::now() < deadline, "shard {id} not {state} within {timeout:?}: {states:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a process beside the cluster (stopped with it); its output goes to `log`.
    pub fn spawn(&mut self, args: &[&str], log: &Path) -> u32 {
        let out = std::fs::File::create(log).unwrap();
        let c = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        let pid = c.id();
        self.extra.push(c);
        pid
    }

    /// Kills one of the processes this test started beside the cluster.
    pub fn kill_extra(&mut self, pid: u32) {
        if let Some(i) = self.extra.iter().position(|c| c.id() == pid) {
            let mut c = self.extra.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        for c in &mut self.extra {
            stop_child(c, Duration::from_secs(5));
        }
        if let Some(mut up) = self.up.take() {
            stop_child(&mut up, Duration::from_secs(20));
        }
        // Whatever `up` could not stop (it was killed, say): by pid, if still ours.
        if !self.info.is_null() {
            let mut pids = vec![self.info["meta"]["pid"].as_u64(), self.info["nbd"]["pid"].as_u64()];
            pids.extend(self.info["shards"].as_array().unwrap().iter().map(|s| s["pid"].as_u64()));
            for pid in pids.into_iter().flatten() {
                if is_understudy(pid as u32) {
                    signal(pid as u32, libc::SIGKILL);
                }
            }
        }
        if std::thread::panicking() {
            eprintln!("--- understudy up output:\n{}", self.up_output());
            for log in ["meta", "nbd", "shard-1", "shard-2", "shard-3", "shard-4"] {
                let p = self.dir.path().join("logs").join(format!("{log}.log"));
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                eprintln!("--- {log}.log (last lines):");
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

pub fn expect_one_line_error(o: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "`{what}` succeeded but should fail: {}", String::from_utf8_lossy(&o.stdout));
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "`{what}`: the error should be one line, got:\n{stderr}");
    assert!(lines[0].starts_with("error: "), "`{what}`: {stderr}");
    stderr
}

/// `qemu-io -f raw -c CMD... URI`: (every command succeeded, output).
pub fn qemu_io(uri: &str, commands: &[&str]) -> (bool, String) {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let o = cmd.arg(uri).stdin(Stdio::null()).output().expect("qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    (o.status.success() && !text.contains("failed"), text)
}

#[track_caller]
pub fn qemu_ok(uri: &str, commands: &[&str]) {
    let (ok, text) = qemu_io(uri, commands);
    assert!(ok, "qemu-io {commands:?} on {uri}:\n{text}");
}

/// An interactive qemu-io: one NBD connection kept open across commands.
pub struct QemuSession {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl QemuSession {
    pub fn open(uri: &str) -> QemuSession {
        let mut child = Command::new("qemu-io")
            .args(["-f", "raw", uri])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(mut l) = line else { return };
                while let Some(rest) = l.strip_prefix("qemu-io> ") {
                    l = rest.to_string();
                }
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        let mut s = QemuSession { stdin: child.stdin.take(), child, lines };
        s.send("length");
        s.lines.recv_timeout(Duration::from_secs(60)).expect("qemu-io could not open the volume");
        s
    }

    fn send(&mut self, c: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{c}").unwrap();
        stdin.flush().unwrap();
    }

    /// (succeeded, output)
    pub fn cmd(&mut self, c: &str) -> (bool, String) {
        self.send(c);
        let mut text = String::new();
        loop {
            let line = self.lines.recv_timeout(Duration::from_secs(90)).unwrap_or_else(|_| panic!("qemu-io: no answer to `{c}`: {text}"));
            text.push_str(&line);
            text.push('\n');
            if line.contains(" ops; ") || line.contains(" failed: ") {
                break;
            }
        }
        (!text.contains("failed"), text)
    }
}

impl Drop for QemuSession {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(3);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop_child(&mut self.child, Duration::from_secs(5));
    }
}

/// Runs `understudy ARGS --out DIR/out` in `dir`, asserts it succeeded, and returns the JSON of
/// its last stdout line (the BENCH.md report). No figure is checked here: that is each test's.
pub fn run_bench(dir: &Path, args: &[&str]) -> serde_json::Value {
    let o = Command::new(BIN).args(args).arg("--out").arg(dir.join("out")).current_dir(dir).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "`understudy {}` failed: {}\n{stdout}", args.join(" "), String::from_utf8_lossy(&o.stderr));
    let last = stdout.lines().last().expect("some stdout");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

/// Asserts a bench run in `dir` removed every cluster directory it made.
pub fn assert_no_cluster_left(dir: &Path) {
    let left = std::fs::read_dir(dir.join("target/bench-clusters")).unwrap().count();
    assert_eq!(left, 0, "a cluster directory was not removed");
}
