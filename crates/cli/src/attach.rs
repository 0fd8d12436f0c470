//! `volume attach` / `volume detach`: a volume as a mounted file system.
//!
//! The FUSE file that the loop device reads must be served for as long as the file system is
//! mounted, by a process that holds the volume open. The design:
//!
//! * `attach --foreground` does it all in this process: open the volume, FUSE-mount it as one
//!   file, `losetup`, optional `mkfs.ext4`, `mount`; write a state file; serve until SIGINT or
//!   SIGTERM; then `umount`, `losetup -d`, FUSE unmount, and remove the state file.
//! * `attach` (the default) starts that same foreground command as a background helper in its
//!   own session (`setsid`, output to a log file), waits until the helper reports on its stdout
//!   that the file system is mounted (or exits, whose log then tells why), and returns.
//! * `detach DIR` reads the state file of DIR, sends SIGTERM to the helper and waits for it to
//!   exit; the helper removes its state file only once everything is undone, so a file left
//!   behind carries the error. If the helper died (SIGKILL), detach cleans up the mount, the loop
//!   device and the FUSE mount itself.
//!
//! State files live in /run/understudy/attach/ (root) or $XDG_RUNTIME_DIR/understudy/attach/,
//! one per mount directory: `<name>.json` (pid, volume, loop device, FUSE file, log) and
//! `<name>.log` (the helper's log).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::{Deserialize, Serialize};

use testbed::proc;
use crate::ConnArgs;

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The volume to attach.
    pub name: String,
    /// Existing directory to mount the file system on.
    #[arg(long, value_name = "DIR")]
    pub mount: PathBuf,
    /// Make a fresh ext4 file system first (destroys what the volume holds).
    #[arg(long)]
    pub mkfs: bool,
    /// Serve in this process until Ctrl-C or `volume detach`, instead of a background helper.
    #[arg(long)]
    pub foreground: bool,
    /// Internal: run as the background helper of `attach`.
    #[arg(long, hide = true)]
    pub helper: bool,
    #[command(flatten)]
    pub conn: crate::VolumeConn,
}

#[derive(Args, Debug)]
pub struct DetachArgs {
    /// The directory given to `volume attach --mount`.
    pub dir: PathBuf,
    /// Accepted like every volume command's connection options (scripts pass them to all of
    /// them); detach needs no cluster: it works from what `attach` left on this machine.
    #[command(flatten)]
    pub conn: crate::VolumeConn,
}

/// How long `attach` waits for its helper (mkfs.ext4 of a large volume takes a while).
const HELPER_READY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long `detach` waits for the helper to undo everything (umount retries, loop release).
const HELPER_EXIT_TIMEOUT: Duration = Duration::from_secs(120);
const READY_PREFIX: &str = "attached ";

#[derive(Serialize, Deserialize, Debug, Clone)]
struct AttachState {
    pid: u32,
    volume: String,
    mount_dir: PathBuf,
    loop_device: Option<PathBuf>,
    fuse_file: Option<PathBuf>,
    log: PathBuf,
    /// Set by the helper when its detach failed.
    detach_error: Option<String>,
}

fn state_dir() -> anyhow::Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let dir = if euid == 0 {
        PathBuf::from("/run/understudy/attach")
    } else if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR") {
        PathBuf::from(x).join("understudy/attach")
    } else {
        std::env::temp_dir().join(format!("understudy-{euid}/attach"))
    };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// State and log file of a mount directory: a readable name plus a hash of the full path.
fn state_paths(mount_dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let text = mount_dir.to_string_lossy();
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    let readable: String = text
        .chars()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let base = format!("{}-{hash:016x}", readable.trim_matches('_'));
    let dir = state_dir()?;
    Ok((dir.join(format!("{base}.json")), dir.join(format!("{base}.log"))))
}

fn load_state(path: &Path) -> Option<AttachState> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn save_state(path: &Path, s: &AttachState) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(s)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn is_mountpoint(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let d = dir.to_string_lossy();
    text.lines().any(|l| l.split(' ').nth(4) == Some(d.as_ref()))
}

fn helper_alive(s: &AttachState) -> bool {
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", s.pid)).unwrap_or_default();
    proc::alive(s.pid) && String::from_utf8_lossy(&cmdline).contains("attach")
}

fn canonical_mount_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    let d = dir.canonicalize().with_context(|| format!("mount directory {}", dir.display()))?;
    anyhow::ensure!(d.is_dir(), "{} is not a directory", d.display());
    Ok(d)
}

fn check_free(mount_dir: &Path, state_file: &Path) -> anyhow::Result<()> {
    if let Some(s) = load_state(state_file) {
        if helper_alive(&s) {
            anyhow::bail!(
                "{} is already attached (volume {}, helper pid {}); `understudy volume detach {}` first",
                mount_dir.display(),
                s.volume,
                s.pid,
                mount_dir.display()
            );
        }
    }
    anyhow::ensure!(!is_mountpoint(mount_dir), "{} is already a mount point; unmount it first", mount_dir.display());
    Ok(())
}

fn abs(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

pub fn attach(conn: &ConnArgs, a: AttachArgs, verbose: u8) -> anyhow::Result<()> {
    let mount_dir = canonical_mount_dir(&a.mount)?;
    let (state_file, log_file) = state_paths(&mount_dir)?;
    if a.foreground || a.helper {
        return serve(conn, &a, &mount_dir, &state_file, &log_file);
    }
    check_free(&mount_dir, &state_file)?;
    // Fail fast on a wrong cluster or volume name, before starting anything.
    let target = conn.target()?;
    let rt = crate::runtime()?;
    rt.block_on(async { target.connect().await?.volume_info(&a.name).await })?;

    let exe = std::env::current_exe()?;
    let mut args: Vec<std::ffi::OsString> = vec!["volume".into()];
    if let Some(c) = &conn.cluster {
        args.extend(["--cluster".into(), abs(c).into_os_string()]);
    }
    if let Some(m) = &conn.meta {
        args.extend(["--meta".into(), m.into()]);
    }
    if let Some(s) = &conn.secret_file {
        args.extend(["--secret-file".into(), abs(s).into_os_string()]);
    }
    if conn.cluster.is_none() && (conn.meta.is_none() || conn.secret_file.is_none()) {
        // The default cluster file is relative to this directory; the helper runs from /.
        let default = Path::new(testbed::cluster_file::DEFAULT_DIR).join(testbed::cluster_file::CLUSTER_FILE);
        args.extend(["--cluster".into(), abs(&default).into_os_string()]);
    }
    args.extend(["attach".into(), a.name.clone().into(), "--mount".into(), mount_dir.clone().into_os_string(), "--helper".into()]);
    if a.mkfs {
        args.push("--mkfs".into());
    }
    if verbose > 0 {
        args.push(format!("-{}", "v".repeat(verbose as usize)).into());
    }
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_file)?;
    let mut cmd = Command::new(exe);
    cmd.args(&args).current_dir("/").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log));
    // SAFETY: setsid is async-signal-safe; it detaches the helper from our terminal and session.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the attach helper")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(HELPER_READY_TIMEOUT).unwrap_or_default();
    if let Some(rest) = line.trim_end().strip_prefix(READY_PREFIX) {
        println!("attached {rest}");
        eprintln!(
            "served by helper pid {} (log {}); `understudy volume detach {}` to detach",
            child.id(),
            log_file.display(),
            mount_dir.display()
        );
        return Ok(());
    }
    // The helper failed (or is stuck): stop it, and show why.
    if let Ok(None) = child.try_wait() {
        proc::signal(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + HELPER_EXIT_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let tail = proc::tail(&log_file, 20);
    let reason = tail.lines().rev().find(|l| l.starts_with("error: ")).map(|l| l.trim_start_matches("error: ").to_string());
    match reason {
        Some(r) => anyhow::bail!("{r} (helper log: {})", log_file.display()),
        None => anyhow::bail!("the attach helper did not report success; see {}", log_file.display()),
    }
}

/// The foreground attach: attach, serve until a stop signal, detach.
fn serve(conn: &ConnArgs, a: &AttachArgs, mount_dir: &Path, state_file: &Path, log_file: &Path) -> anyhow::Result<()> {
    check_free(mount_dir, state_file)?;
    let target = conn.target()?;
    let rt = crate::runtime()?;
    // Catch SIGTERM/SIGINT from now on, so a `detach` never kills us half-way.
    let (mut term, mut int) = {
        let _g = rt.enter();
        use tokio::signal::unix::{signal, SignalKind};
        (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?)
    };
    let t_open = Instant::now();
    let vol = rt.block_on(async { target.connect().await?.open(&a.name).await })?;
    let open_time = t_open.elapsed();
    let size = vol.record().size_bytes;
    let mut cfg = fusefile::AttachConfig::new(format!("{}.img", a.name), rt.handle().clone());
    cfg.mkfs_ext4 = a.mkfs;
    // fusefile's attach must run off the runtime's worker threads: this is the main thread.
    let mut attached = fusefile::attach(Arc::new(vol), mount_dir, cfg).map_err(anyhow::Error::from)?;
    let mut state = AttachState {
        pid: std::process::id(),
        volume: a.name.clone(),
        mount_dir: mount_dir.to_path_buf(),
        loop_device: attached.loop_device().map(Path::to_path_buf),
        fuse_file: attached.backing_file().map(Path::to_path_buf),
        log: log_file.to_path_buf(),
        detach_error: None,
    };
    if let Err(e) = save_state(state_file, &state) {
        let _ = attached.detach();
        return Err(e.context("cannot write the attach state file"));
    }
    let loop_text = state.loop_device.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
    // Where the attach went (a failover's backup waits for all of it): `open=… fuse=… ms`.
    let steps: Vec<String> =
        std::iter::once(("open", open_time)).chain(attached.step_times().iter().copied()).map(|(n, d)| format!("{n}={:.1}", d.as_secs_f64() * 1000.0)).collect();
    println!(
        "{READY_PREFIX}{} ({}) at {} via {loop_text}{} [{} ms]",
        a.name,
        crate::size::format_size(size),
        mount_dir.display(),
        if a.mkfs { ", fresh ext4" } else { "" },
        steps.join(" ")
    );
    let _ = std::io::stdout().flush();
    // Whoever reads our stdout (the background `attach`, or a failover monitor that may itself
    // be restarted) can go away after the ready line: nothing more goes to a pipe, so a later
    // print cannot kill the helper with a broken pipe while it serves a mounted file system.
    if a.helper || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
            use std::os::fd::AsRawFd;
            // SAFETY: dup2 of an open fd we own onto fd 1; fd 1 stays open after `null` drops.
            unsafe { libc::dup2(null.as_raw_fd(), 1) };
        }
    }
    if !a.helper {
        eprintln!("Ctrl-C or `understudy volume detach {}` detaches", mount_dir.display());
    }
    tracing::info!(volume = %a.name, mount = %mount_dir.display(), "attached; serving the FUSE file");
    let sig = rt.block_on(async {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    });
    tracing::info!("{sig} received: detaching {}", mount_dir.display());
    match attached.detach() {
        Ok(()) => {
            let _ = std::fs::remove_file(state_file);
            tracing::info!("detached {}", mount_dir.display());
            Ok(())
        }
        Err(e) => {
            state.detach_error = Some(e.to_string());
            let _ = save_state(state_file, &state);
            Err(anyhow::Error::from(e).context(format!("detaching {}", mount_dir.display())))
        }
    }
}

/// A clean-up command with a deadline: a wedged `umount` or `losetup` is reported, not waited on.
fn run_quiet(program: &str, args: &[&str]) -> Result<(), String> {
    failover::pool::teardown::run_bounded(program, args, failover::pool::teardown::COMMAND_TIMEOUT).map(|_| ())
}

/// How long `detach` waits for the kernel to release a loop device after `losetup -d`.
const LOOP_RELEASE_TIMEOUT: Duration = Duration::from_secs(15);

/// Whether loop device `name` (`loop3`) is still attached to `file`.
fn loop_reads(name: &str, file: &Path) -> bool {
    std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).is_ok_and(|b| b.trim() == file.to_string_lossy())
}

pub fn detach(a: DetachArgs) -> anyhow::Result<()> {
    let mount_dir = a.dir.canonicalize().unwrap_or_else(|_| abs(&a.dir));
    let (state_file, _) = state_paths(&mount_dir)?;
    let Some(state) = load_state(&state_file) else {
        if is_mountpoint(&mount_dir) {
            anyhow::bail!(
                "{} is mounted, but not by `understudy volume attach` (no state in {}); use umount",
                mount_dir.display(),
                state_file.parent().unwrap().display()
            );
        }
        anyhow::bail!("nothing is attached at {}", mount_dir.display());
    };
    if helper_alive(&state) {
        proc::signal(state.pid, libc::SIGTERM);
        let deadline = Instant::now() + HELPER_EXIT_TIMEOUT;
        while proc::alive(state.pid) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the attach helper (pid {}) is still detaching after {HELPER_EXIT_TIMEOUT:?}; see {}",
                state.pid,
                state.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        match load_state(&state_file) {
            None => {
                let _ = std::fs::remove_file(&state.log);
                println!("detached {}", mount_dir.display());
                return Ok(());
            }
            Some(s) if s.detach_error.is_some() => {
                let _ = std::fs::remove_file(&state_file);
                anyhow::bail!("detach of {} failed: {} (log {})", mount_dir.display(), s.detach_error.unwrap(), state.log.display());
            }
            Some(_) => {} // died before detaching: clean up below
        }
    }
    // The helper is gone without detaching (killed): undo what is left, best effort.
    let mut problems = vec![];
    if is_mountpoint(&mount_dir) {
        if let Err(e) =
            run_quiet("umount", &[&mount_dir.to_string_lossy()]).or_else(|_| run_quiet("umount", &["-l", &mount_dir.to_string_lossy()]))
        {
            problems.push(e);
        }
    }
    if let (Some(l), Some(f)) = (&state.loop_device, &state.fuse_file) {
        let name = l.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if loop_reads(&name, f) {
            // `losetup -d` of a device still held (a lazily unmounted file system that a
            // process keeps open) only sets autoclear and succeeds: the device goes when its
            // last holder lets go. Detached means released, so wait for that, bounded.
            match run_quiet("losetup", &["-d", &l.to_string_lossy()]) {
                Err(e) => problems.push(e),
                Ok(()) => {
                    let deadline = Instant::now() + LOOP_RELEASE_TIMEOUT;
                    while loop_reads(&name, f) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    // Not released: the FUSE file it reads and the state stay, so that
                    // `detach` run again (once the holder is gone) finishes the job.
                    anyhow::ensure!(
                        !loop_reads(&name, f),
                        "the attach helper (pid {}) had died; {} is still attached {LOOP_RELEASE_TIMEOUT:?} after `losetup -d`: \
                         something holds it open (a process with files on {}? check `fuser -m {}`); it is released when that \
                         lets go; run detach again then{}",
                        state.pid,
                        l.display(),
                        mount_dir.display(),
                        l.display(),
                        if problems.is_empty() { String::new() } else { format!(" (also: {})", problems.join("; ")) }
                    );
                }
            }
        }
    }
    if let Some(fuse_dir) = state.fuse_file.as_ref().and_then(|f| f.parent()) {
        if is_mountpoint(fuse_dir) {
            if let Err(e) = run_quiet("umount", &["-l", &fuse_dir.to_string_lossy()]) {
                problems.push(e);
            }
        }
        let _ = std::fs::remove_dir(fuse_dir);
    }
    let _ = std::fs::remove_file(&state_file);
    anyhow::ensure!(problems.is_empty(), "the attach helper (pid {}) had died; cleaning up: {}", state.pid, problems.join("; "));
    println!("detached {} (its helper, pid {}, had died; cleaned up after it)", mount_dir.display(), state.pid);
    Ok(())
}
