//! Driving `qemu-io`, the real NBD client the demo uses: one-shot runs (`-c` commands) and
//! interactive sessions that keep one NBD connection open across commands, as an application
//! keeps its disk open.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::Context;

/// How long one qemu-io command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
const PROMPT: &str = "qemu-io> ";

pub fn check_installed() -> anyhow::Result<()> {
    match Command::new("qemu-io").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(s) if s.success() => Ok(()),
        _ => anyhow::bail!("qemu-io is needed (the demo uses it as a real NBD client): apt-get install qemu-utils"),
    }
}

/// The outcome of one command.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// No failure and no pattern mismatch.
    pub ok: bool,
    pub text: String,
}

/// Runs `qemu-io -f raw -c CMD... URI` and reports whether every command succeeded.
pub fn run(uri: &str, commands: &[&str]) -> anyhow::Result<Outcome> {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = cmd.arg(uri).stdin(Stdio::null()).output().context("cannot run qemu-io")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let ok = out.status.success() && !text.contains("failed");
    Ok(Outcome { ok, text })
}

/// An interactive qemu-io with one NBD connection open.
pub struct Session {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Receiver<String>,
}

impl Session {
    pub fn open(uri: &str) -> anyhow::Result<Session> {
        let mut child = Command::new("qemu-io")
            .args(["-f", "raw", uri])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start qemu-io (apt-get install qemu-utils)")?;
        let stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(mut line) = line else { return };
                // Prompts come without a newline, in front of the next output.
                while let Some(rest) = line.strip_prefix(PROMPT) {
                    line = rest.to_string();
                }
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let (etx, erx) = channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            let _ = etx.send(s);
        });
        let mut s = Session { stdin: child.stdin.take(), child, lines, stderr: erx };
        // `length` answers with one line once the device is open.
        s.send("length")?;
        match s.lines.recv_timeout(COMMAND_TIMEOUT) {
            Ok(_) => Ok(s),
            Err(_) => {
                let err = s.stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                anyhow::bail!("qemu-io cannot open {uri}: {}", err.trim())
            }
        }
    }

    fn send(&mut self, command: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("session closed")?;
        writeln!(stdin, "{command}").and_then(|_| stdin.flush()).context("qemu-io exited")
    }

    /// Runs a read or write command and waits for its result.
    pub fn cmd(&mut self, command: &str) -> anyhow::Result<Outcome> {
        self.send(command)?;
        let mut text = String::new();
        loop {
            let line = match self.lines.recv_timeout(COMMAND_TIMEOUT) {
                Ok(l) => l,
                Err(RecvTimeoutError::Timeout) => anyhow::bail!("qemu-io did not answer `{command}` within {COMMAND_TIMEOUT:?}"),
                Err(RecvTimeoutError::Disconnected) => {
                    let err = self.stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                    anyhow::bail!("qemu-io exited during `{command}`: {}{}", text, err.trim())
                }
            };
            text.push_str(&line);
            text.push('\n');
            // Success ends with the statistics line; a failure is one line.
            if line.contains(" ops; ") || line.contains(" failed: ") {
                break;
            }
        }
        let ok = !text.contains("failed");
        Ok(Outcome { ok, text })
    }

    /// Closes the session (qemu-io disconnects cleanly on end of input).
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        drop(self.stdin.take());
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shutdown();
    }
}
