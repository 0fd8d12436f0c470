//! What a previous run of the monitor left: instances still running (adopted: a monitor crash
//! is not an instance crash), starts it left half-way and attach helpers it never recorded
//! (reaped), file systems a dead helper left mounted (unmounted from what the kernel shows).

use std::collections::HashSet;

use super::*;

impl LocalPool {
    /// Adopts the instances a previous run of the monitor left running (same processes, same
    /// start times); returns their ids. Call once, before the monitor starts.
    pub async fn adopt(&self) -> Vec<InstanceId> {
        let Ok(bytes) = std::fs::read(self.saved_path()) else { return vec![] };
        let Ok(saved) = serde_json::from_slice::<SavedPool>(&bytes) else {
            tracing::warn!("ignoring unreadable {}", self.saved_path().display());
            return vec![];
        };
        self.killed.lock().unwrap().extend(saved.killed.iter().copied());
        for s in &saved.starting {
            tracing::info!(id = %s.id, attach_pid = s.attach_pid, "reaping a start the previous run left half-way");
            self.reap(s).await;
        }
        let mut adopted = vec![];
        for s in saved.instances {
            let alive = start_time(s.app_pid) == Some(s.app_start) && start_time(s.attach_pid) == Some(s.attach_start);
            if !alive {
                // One may be gone and the other not (an app that crashed beside a live helper
                // holding the mount): nothing of it may stay.
                tracing::info!(id = %s.id, "instance of the previous run is gone; reaping what is left of it");
                self.reap(&s).await;
                continue;
            }
            let link = match &s.netns {
                Some(l) => Link::Netns { link: l.clone(), addr: (l.ns_addr, s.app_port).into() },
                None => {
                    let app_addr: SocketAddr = ([127, 0, 0, 1], s.app_port).into();
                    let Ok(proxy) = Proxy::bind((self.link_ip, 0).into(), Some(app_addr)).await else { continue };
                    Link::Proxy { proxy, app_addr }
                }
            };
            let expected_exit = Arc::new(AtomicBool::new(false));
            // Not our children any more: watch them by pid.
            let (events, flag, id, pids) = (self.events.clone(), expected_exit.clone(), s.id, [s.app_pid, s.attach_pid]);
            tokio::spawn(async move {
                while pids.iter().all(|p| pid_alive(*p)) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if !flag.load(Ordering::SeqCst) {
                    let _ = events.send(Input::InstanceExited(id)).await;
                }
            });
            tracing::info!(id = %s.id, addr = %link.address(), "adopted a running instance");
            adopted.push(s.id);
            self.insts.lock().unwrap().insert(
                s.id,
                Inst {
                    cgroup: self.group_dir(s.id).filter(|d| d.exists()),
                    timing: StartTiming::default(),
                    pgid: s.pgid,
                    app_pid: s.app_pid,
                    app_pgid: if s.app_pgid != 0 { s.app_pgid } else { s.pgid },
                    attach_pid: s.attach_pid,
                    link,
                    mount: s.mount.clone(),
                    expected_exit,
                    _attach_stdout: None,
                    saved: s,
                },
            );
        }
        // A helper this run has no record of (the previous one crashed between spawning it
        // and recording it): found by its `--mount` argument, reaped like the others.
        let ours: HashSet<PathBuf> = self.insts.lock().unwrap().values().map(|i| i.mount.clone()).collect();
        for d in std::fs::read_dir(self.cfg.state_dir.join("mnt")).into_iter().flatten().flatten() {
            let mount = d.path();
            if ours.contains(&mount) {
                continue;
            }
            for pid in helpers_of(&mount) {
                tracing::info!(mount = %mount.display(), pid, "reaping an attach helper the previous run left unrecorded");
                // Its application (found by the mount it runs in) first, then the stack.
                for app in procs_in(&mount) {
                    signal_pid(app, libc::SIGKILL);
                }
                if let Err(e) = take_down(pid, true, &mount).await {
                    tracing::error!(pid, "reaping an unrecorded attach helper: {e}");
                }
            }
            self.unmount_all(&mount).await;
        }
        self.save();
        adopted
    }

    /// Takes down what a previous run of the monitor left of an instance it no longer
    /// serves: its application (SIGKILL, only if still the process that was recorded: pids
    /// are reused), then its volume stack, the helper last ([`teardown::take_down_helper`]).
    async fn reap(&self, s: &SavedInst) {
        // Its cgroup holds every process of its application, whatever its pids are now.
        if let Some(d) = self.group_dir(s.id) {
            let r = tokio::task::spawn_blocking(move || unit::kill_group(&d, unit::KILL_TIMEOUT)).await;
            if let Ok(Err(e)) = r {
                tracing::warn!(id = %s.id, "{e}");
            }
        }
        if s.app_pid != 0 && start_time(s.app_pid) == Some(s.app_start) {
            if s.app_pgid != 0 {
                signal_group(s.app_pgid, libc::SIGKILL);
            }
            signal_pid(s.app_pid, libc::SIGKILL);
            if !Self::wait_gone(&[s.app_pid], teardown::EXIT_TIMEOUT).await {
                tracing::warn!(id = %s.id, "application of the previous run still alive after SIGKILL");
            }
        }
        let ours = s.attach_pid != 0 && start_time(s.attach_pid) == Some(s.attach_start);
        if s.attach_pid != 0 {
            if let Err(e) = take_down(s.attach_pid, ours, &s.mount).await {
                tracing::error!(id = %s.id, "reaping the previous run's instance: {e}");
            }
        }
        self.unmount_all(&s.mount).await;
        if let Some(l) = &s.netns {
            let _ = netns::delete(&l.name);
        }
    }

    /// `volume detach` of an instance's mount point, and when that leaves something (a helper
    /// killed before it wrote its state file: no record of the stack), the stack found from
    /// the kernel: ext4 mount → its loop device → the FUSE file behind it → the FUSE mount.
    pub(super) async fn unmount_all(&self, mount: &Path) {
        let _ = self.detach(mount).await;
        let Some(dev) = mount_source(mount) else { return };
        let backing = dev
            .strip_prefix("/dev/")
            .and_then(|name| std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok())
            .map(|b| PathBuf::from(b.trim()));
        tracing::info!(mount = %mount.display(), %dev, "unmounting what a dead attach helper left");
        run_logged("umount", &["-l".as_ref(), mount.as_os_str()]).await;
        if let Some(b) = backing {
            run_logged("losetup", &["-d".as_ref(), dev.as_ref()]).await;
            if let Some(fuse_dir) = b.parent().filter(|d| mount_source(d).is_some()) {
                run_logged("umount", &["-l".as_ref(), fuse_dir.as_os_str()]).await;
                let _ = std::fs::remove_dir(fuse_dir);
            }
        }
    }
}

/// The source (device) of the file system mounted at `dir`, if `dir` is a mount point.
fn mount_source(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // Canonical like the kernel's (the parent only: a dead FUSE mount must not be stat'ed).
    let dir = match (dir.parent().and_then(|p| p.canonicalize().ok()), dir.file_name()) {
        (Some(p), Some(n)) => p.join(n),
        _ => dir.to_path_buf(),
    };
    let d = dir.to_string_lossy();
    // Fields: id parent major:minor root mount-point options ... - fstype source super-options.
    text.lines().rev().find(|l| l.split(' ').nth(4) == Some(d.as_ref())).and_then(|l| l.split(" - ").nth(1)?.split(' ').nth(1).map(str::to_string))
}

/// Live `volume attach` helpers whose `--mount` is `mount`.
fn helpers_of(mount: &Path) -> Vec<u32> {
    let want = mount.as_os_str().as_encoded_bytes();
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is_helper = args.contains(&&b"attach"[..]) && args.windows(2).any(|w| w[0] == b"--mount" && w[1] == want);
        if is_helper && pid_alive(pid) {
            v.push(pid);
        }
    }
    v
}

/// Runs a clean-up command with a deadline ([`teardown::run_bounded`]); a failure (a wedged
/// `losetup` or `umount` included) is logged and the caller goes on with the next step.
async fn run_logged(prog: &str, args: &[&std::ffi::OsStr]) {
    let (prog, args): (String, Vec<String>) = (prog.to_string(), args.iter().map(|a| a.to_string_lossy().into_owned()).collect());
    let r = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        teardown::run_bounded(&prog, &args, teardown::COMMAND_TIMEOUT)
    })
    .await;
    match r {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!("{e}"),
        Err(e) => tracing::warn!("clean-up command panicked: {e}"),
    }
}

/// Processes whose working directory is `mount` (an instance's application and its children).
fn procs_in(mount: &Path) -> Vec<u32> {
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c == mount) {
            v.push(pid);
        }
    }
    v
}
