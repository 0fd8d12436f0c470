//! Starting an instance: its volume attached by a `volume attach --foreground` helper (its
//! network namespace made meanwhile), then its application spawned in its own process group,
//! cgroup and namespace, reached through its link, watched for an exit nobody asked for. Every
//! error path takes down what was made.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, RawFd};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::*;
use crate::spec::substitute;

/// Making (or taking the spare) namespace of a start, beside its attach.
type NsTask = tokio::task::JoinHandle<Result<(netns::Lock, NetnsLink, std::os::fd::OwnedFd), netns::NetnsError>>;

impl LocalPool {
    pub(super) async fn start_inner(&self, id: InstanceId, volume: &str) -> Result<SocketAddr, PoolError> {
        let requested_unix_ms = now_unix_ms();
        let mount = self.mount_dir(id);
        std::fs::create_dir_all(&mount).map_err(|e| PoolError::Io { id, msg: format!("cannot create {}: {e}", mount.display()) })?;
        let attach_log = self.cfg.state_dir.join("logs").join(format!("{id}.attach.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&attach_log)
            .map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        // The namespace is made (or the spare taken) while the volume attaches, not after.
        // Its lock is held from then until the application is in it, so a concurrent sweep
        // never takes it for stale.
        let ns_task = self.cfg.netns.then(|| self.make_namespace(id));
        let mut cmd = Command::new(&self.cfg.exe);
        cmd.arg("volume").args(&self.cfg.conn_args).args(["attach", volume, "--mount"]).arg(&mount).arg("--foreground");
        if self.cfg.mkfs_first && id == InstanceId(1) {
            cmd.arg("--mkfs");
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log)).process_group(0).kill_on_drop(false);
        let attach: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                drop_namespace(ns_task).await;
                return Err(PoolError::Attach { id, volume: volume.into(), msg: format!("cannot run {}: {e}", self.cfg.exe.display()) });
            }
        };
        let attach_pid = attach.id().unwrap_or(0);
        let pgid = attach_pid as i32;
        // Durable before we wait for it: a crash of this monitor from here on leaves a record
        // the next run reaps (see `adopt`).
        self.starting.lock().unwrap().insert(
            id,
            SavedInst {
                id,
                pgid,
                app_pid: 0,
                app_start: 0,
                attach_pid,
                attach_start: start_time(attach_pid).unwrap_or(0),
                app_port: 0,
                mount: mount.clone(),
                app_pgid: 0,
                netns: None,
            },
        );
        self.save();
        let r = self.start_attached(id, volume, attach, mount, pgid, attach_log, ns_task, requested_unix_ms).await;
        self.starting.lock().unwrap().remove(&id);
        self.save();
        r
    }

    /// Instance `id`'s namespace, off the runtime: the spare made ahead for it if there is
    /// one, else a new one; returned with the namespace lock held and a descriptor to enter it.
    fn make_namespace(&self, id: InstanceId) -> NsTask {
        let spare = self.spare.clone();
        let name = netns::name_for(&self.tag, &id.to_string());
        tokio::task::spawn_blocking(move || -> Result<(netns::Lock, NetnsLink, std::os::fd::OwnedFd), netns::NetnsError> {
            let l = netns::lock()?;
            let taken = {
                let mut g = spare.lock().unwrap();
                match g.take() {
                    Some((s, link)) if s == id => link, // a spare still being made is cancelled
                    other => {
                        *g = other;
                        None
                    }
                }
            };
            let link = match taken {
                Some(link) if Path::new("/run/netns").join(&link.name).exists() => link,
                _ => netns::create(&name, &l)?,
            };
            match netns::open(&link.name) {
                Ok(fd) => Ok((l, link, fd)),
                Err(e) => {
                    let _ = netns::delete(&link.name);
                    Err(e)
                }
            }
        })
    }

    /// The rest of a start once the attach helper runs: wait for its mount, then the
    /// application. Every error path takes down what was made. (One function of about 100
    /// lines on purpose: each step's clean-up undoes exactly the steps before it, which reads
    /// best in one sequence.)
    #[allow(clippy::too_many_arguments)]
    async fn start_attached(
        &self,
        id: InstanceId,
        volume: &str,
        mut attach: Child,
        mount: PathBuf,
        pgid: i32,
        attach_log: PathBuf,
        ns_task: Option<NsTask>,
        requested_unix_ms: u64,
    ) -> Result<SocketAddr, PoolError> {
        let attach_pid = pgid as u32;
        let mut stdout = BufReader::new(attach.stdout.take().expect("piped"));
        let mut line = String::new();
        let ready = tokio::time::timeout(self.cfg.attach_timeout, stdout.read_line(&mut line)).await;
        if !matches!(ready, Ok(Ok(n)) if n > 0 && line.starts_with("attached")) {
            drop_namespace(ns_task).await;
            self.abandon(pgid, &mut attach, &mount).await;
            let why = match ready {
                Err(_) => format!("not attached within {:?}", self.cfg.attach_timeout),
                _ => tail(&attach_log, 3),
            };
            return Err(PoolError::Attach { id, volume: volume.into(), msg: why });
        }
        let attached_unix_ms = now_unix_ms();
        let attach_steps_ms = parse_attach_steps(&line);
        // The application, in the same process group (and its own network namespace).
        let port = free_port().map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let (ns_lock, ns) = match ns_task {
            Some(t) => match t.await.map_err(|e| netns::NetnsError(format!("making the namespace: {e}"))).and_then(|r| r) {
                Ok((l, link, fd)) => (Some(l), Some((link, fd))),
                Err(e) => {
                    self.abandon(pgid, &mut attach, &mount).await;
                    return Err(PoolError::Io { id, msg: e.to_string() });
                }
            },
            None => (None, None),
        };
        let host: IpAddr = ns.as_ref().map_or(Ipv4Addr::LOCALHOST, |(l, _)| l.ns_addr).into();
        let (mut app, program) = self.app_command(id, &mount, host, port, ns.as_ref().map(|(_, fd)| fd.as_raw_fd()))?;
        // Its own cgroup, entered before exec: every process it ever starts is in it, however
        // it daemonizes, and the kill reaches them all.
        let group = match self.containment.create(&self.group_name(id)) {
            Ok(g) => g,
            Err(msg) => {
                drop(ns_lock);
                if let Some((l, _)) = &ns {
                    let _ = netns::delete(&l.name);
                }
                self.abandon(pgid, &mut attach, &mount).await;
                return Err(PoolError::App { id, msg });
            }
        };
        if let Some(g) = &group {
            g.enter_at_spawn(&mut app);
        }
        let spawned = app.spawn();
        drop(ns_lock);
        let cgroup = group.map(|g| g.dir);
        let mut app_child = match spawned {
            Ok(c) => c,
            Err(e) => {
                if let Some(d) = &cgroup {
                    let _ = unit::kill_group(d, unit::KILL_TIMEOUT);
                }
                if let Some((l, _)) = &ns {
                    let _ = netns::delete(&l.name);
                }
                self.abandon(pgid, &mut attach, &mount).await;
                return Err(PoolError::App { id, msg: format!("cannot run {program:?}: {e}") });
            }
        };
        let app_pid = app_child.id().unwrap_or(0);
        let timing = StartTiming { requested_unix_ms, attached_unix_ms, spawned_unix_ms: now_unix_ms(), attach_steps_ms };
        let link = match open_link(ns.map(|(link, _fd)| link), self.link_ip, port).await {
            Ok(l) => l,
            Err(e) => {
                if let Err(e) = kill_app(cgroup.clone(), app_pid as i32, app_pid, start_time(app_pid).unwrap_or(0)).await {
                    tracing::error!(%id, "{e}");
                }
                let _ = tokio::time::timeout(teardown::EXIT_TIMEOUT, app_child.wait()).await;
                self.abandon(pgid, &mut attach, &mount).await;
                return Err(PoolError::Io { id, msg: format!("cannot open the instance's link: {e}") });
            }
        };
        let addr = link.address();
        let expected_exit = self.watch_exit(id, app_child, attach);
        tracing::info!(%id, volume, %addr, app_pid, attach_pid, "instance started");
        let app_pgid = app_pid as i32;
        let saved = SavedInst {
            id,
            pgid,
            app_pgid,
            app_pid,
            app_start: start_time(app_pid).unwrap_or(0),
            attach_pid,
            attach_start: start_time(attach_pid).unwrap_or(0),
            app_port: port,
            mount: mount.clone(),
            netns: link.netns().cloned(),
        };
        self.insts.lock().unwrap().insert(
            id,
            Inst { cgroup, timing, saved, pgid, app_pid, app_pgid, attach_pid, link, mount, expected_exit, _attach_stdout: Some(stdout.into_inner()) },
        );
        self.save();
        Ok(addr)
    }

    /// The application's command (the spec's, with `{mount}`, `{host}`, `{port}`, `{instance}`
    /// substituted), logging to the instance's log, in its own process group, entering the
    /// namespace `ns_fd` (if any) before exec. Also returns the program, for errors.
    fn app_command(&self, id: InstanceId, mount: &Path, host: IpAddr, port: u16, ns_fd: Option<RawFd>) -> Result<(Command, String), PoolError> {
        let inst = id.to_string();
        let args: Vec<String> = self.cfg.app.command.iter().map(|a| substitute(a, mount, host, port, &inst)).collect();
        let app_log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file(id))
            .map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let app_err = app_log.try_clone().map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let mut app = Command::new(&args[0]);
        app.args(&args[1..])
            .current_dir(mount)
            .env("UNDERSTUDY_MOUNT", mount)
            .env("UNDERSTUDY_PORT", port.to_string())
            .env("UNDERSTUDY_HOST", host.to_string())
            .env("UNDERSTUDY_INSTANCE", &inst)
            .stdin(Stdio::null())
            .stdout(Stdio::from(app_log))
            .stderr(Stdio::from(app_err))
            // Its own process group: the application can be killed as a whole without the
            // helper, which must outlive the loop device that reads its FUSE file.
            .process_group(0)
            .kill_on_drop(false);
        for (k, v) in &self.cfg.app.env {
            app.env(k, substitute(v, mount, host, port, &inst));
        }
        if let Some(fd) = ns_fd {
            // SAFETY: the closure runs in the forked child before exec and makes one
            // async-signal-safe system call (setns) on a descriptor the parent keeps open.
            unsafe {
                app.pre_exec(move || netns::enter(fd));
            }
        }
        Ok((app, args[0].clone()))
    }

    /// Reports an exit of the application or of its attach helper that nobody asked for (a
    /// crash) as [`Input::InstanceExited`], unless the returned flag was set first (a kill or
    /// a stop); reaps both once they are gone.
    fn watch_exit(&self, id: InstanceId, mut app_child: Child, mut attach: Child) -> Arc<AtomicBool> {
        let expected_exit = Arc::new(AtomicBool::new(false));
        let events = self.events.clone();
        let flag = expected_exit.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = app_child.wait() => {}
                _ = attach.wait() => {}
            }
            if !flag.load(Ordering::SeqCst) {
                let _ = events.send(Input::InstanceExited(id)).await;
            }
            // Reap whichever is left once it is killed.
            let _ = app_child.wait().await;
            let _ = attach.wait().await;
        });
        expected_exit
    }

    /// Undoes a start that failed once the attach helper ran (attached or not): the volume
    /// stack taken down in the order that cannot hang ([`teardown::take_down_helper`]).
    async fn abandon(&self, pgid: i32, attach: &mut Child, mount: &Path) {
        match take_down(pgid as u32, true, mount).await {
            Ok(()) => {
                let _ = tokio::time::timeout(teardown::EXIT_TIMEOUT, attach.wait()).await;
            }
            Err(e) => tracing::error!(helper = pgid, "abandoning a failed start: {e}"),
        }
        self.unmount_all(mount).await;
    }
}

/// How the instance is reached: at its namespace's address (`ns`), or, without one, through
/// a proxy the pool owns in front of the application's port on the host.
async fn open_link(ns: Option<NetnsLink>, link_ip: IpAddr, port: u16) -> std::io::Result<Link> {
    Ok(match ns {
        Some(link) => Link::Netns { addr: (link.ns_addr, port).into(), link },
        None => {
            let app_addr: SocketAddr = ([127, 0, 0, 1], port).into();
            let proxy = Proxy::bind((link_ip, 0).into(), Some(app_addr)).await?;
            Link::Proxy { proxy, app_addr }
        }
    })
}

/// Deletes the namespace a start made for nothing (its start failed before the application
/// was in it).
async fn drop_namespace(ns_task: Option<NsTask>) {
    if let Some(t) = ns_task {
        if let Ok(Ok((_l, link, _fd))) = t.await {
            let _ = netns::delete(&link.name);
        }
    }
}

/// The `[open=1.2 fuse=0.4 … ms]` suffix of the attach helper's ready line.
fn parse_attach_steps(line: &str) -> Vec<(String, f64)> {
    let Some(inner) = line.trim_end().rsplit_once('[').and_then(|(_, r)| r.strip_suffix("ms]")) else { return vec![] };
    inner.split_whitespace().filter_map(|kv| kv.split_once('=')).filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?))).collect()
}

fn free_port() -> std::io::Result<u16> {
    wire::ports::free_loopback_port()
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join(" | ")
}
