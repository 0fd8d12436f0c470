//! `understudy failover postgres`: runs Debian's unmodified PostgreSQL server as an instance's
//! application.
//!
//! The data directory lives on the instance's volume. On the first start it is made with
//! `initdb` (trust authentication on loopback, superuser `postgres`) into a scratch directory
//! that is renamed into place, so a crash during initdb leaves nothing half made. Every start
//! removes a left-over `postmaster.pid`: the instance owns its volume, so a lock file there was
//! left by a host that crashed (and on a super child, by the primary whose disk it copies).
//! `postgres` runs as an unprivileged user (it refuses root). The postmaster starts every child
//! (each backend, the checkpointer, the WAL writer) in a session of its own, so a SIGKILL of the
//! instance's process group does not reach them: a backend notices its postmaster's death only
//! where it waits, and one in a long query runs on, holding files on the volume. The pool kills
//! the application's cgroup instead, which holds every process it started
//! ([`failover::pool::unit`]). SIGTERM here becomes a fast shutdown (SIGINT), which ends client
//! sessions instead of waiting for them.

use std::path::{Path, PathBuf};

use crate::datadir::lookup_user;
use std::process::Stdio;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
pub struct PgArgs {
    /// The data directory (made with initdb when it holds no cluster yet).
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    /// TCP port (no Unix socket is opened).
    #[arg(long)]
    pub port: u16,
    /// Address to listen on (an instance's pool sets UNDERSTUDY_HOST: its namespace's address).
    #[arg(long, env = "UNDERSTUDY_HOST", default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// The unprivileged user postgres runs as [default: postgres if it exists, else nobody].
    #[arg(long)]
    pub user: Option<String>,
    /// Directory of initdb and postgres [default: the newest /usr/lib/postgresql/*/bin].
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// `max_wal_size` in MiB: how much WAL may pile up between checkpoints, hence how much a
    /// crash recovery may have to replay.
    #[arg(long, default_value_t = 64)]
    pub max_wal_size_mb: u64,
    /// `checkpoint_timeout` in seconds (30 to 86400).
    #[arg(long, default_value_t = 300)]
    pub checkpoint_timeout_s: u64,
    /// `shared_buffers` in MiB.
    #[arg(long, default_value_t = 32)]
    pub shared_buffers_mb: u64,
    /// More `-c NAME=VALUE` settings.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
}

/// The newest PostgreSQL server installed by Debian.
pub fn find_bin_dir() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|d| Some((d.file_name().to_str()?.parse::<u32>().ok()?, d.path().join("bin"))))
        .filter(|(_, p)| p.join("postgres").exists())
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, p)| p)
}

fn chown_tree(p: &Path, uid: u32, gid: u32) -> anyhow::Result<()> {
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).with_context(|| format!("chown {}", p.display()))?;
    if p.is_dir() {
        for e in std::fs::read_dir(p)? {
            chown_tree(&e?.path(), uid, gid)?;
        }
    }
    Ok(())
}

pub fn run(a: PgArgs) -> anyhow::Result<()> {
    anyhow::ensure!((30..=86_400).contains(&a.checkpoint_timeout_s), "--checkpoint-timeout-s must be 30 to 86400");
    anyhow::ensure!((2..=1 << 20).contains(&a.max_wal_size_mb), "--max-wal-size-mb must be 2 to 1048576");
    let bin = match &a.bin_dir {
        Some(b) => b.clone(),
        None => find_bin_dir().context("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres): apt-get install postgresql")?,
    };
    let user = a.user.clone().unwrap_or_else(|| if lookup_user("postgres").is_ok() { "postgres".into() } else { "nobody".into() });
    let (uid, gid) = lookup_user(&user)?;
    let (data, parent) = crate::datadir::reachable_by(&a.data, &user, uid, gid)?;
    if !data.join("PG_VERSION").exists() {
        crate::datadir::make_in_scratch(&data, &parent, "initdb", "PostgreSQL cluster", (uid, gid), Some(0o700), |scratch| {
            eprintln!("understudy failover postgres: initdb {} as {user}", data.display());
            let out = std::process::Command::new(bin.join("initdb"))
                .args(["--auth=trust", "--username=postgres", "--encoding=UTF8", "--locale=C", "--no-instructions", "-D"])
                .arg(scratch)
                .uid(uid)
                .gid(gid)
                .current_dir(&parent)
                .stdin(Stdio::null())
                .output()
                .context("cannot run initdb")?;
            anyhow::ensure!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            Ok(())
        })?;
    }
    // Whatever made the files (a restore, another uid on another host), postgres must own them.
    if std::fs::metadata(&data)?.uid() != uid {
        chown_tree(&data, uid, gid)?;
    }
    // Clients come over the instance's own link (its network namespace's /30) as well as
    // loopback: trust both, as initdb trusts loopback. Added once; it stays in the data.
    let hba = data.join("pg_hba.conf");
    let text = std::fs::read_to_string(&hba).with_context(|| format!("cannot read {}", hba.display()))?;
    if !text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["host", "all", "all", "samenet", "trust"]) {
        std::fs::write(&hba, format!("{text}\n# understudy: clients over the instance's own link\nhost all all samenet trust\n"))?;
    }
    let pid_file = data.join("postmaster.pid");
    if pid_file.exists() {
        eprintln!("understudy failover postgres: removing the lock file a crashed host left ({})", pid_file.display());
        std::fs::remove_file(&pid_file)?;
    }
    let mut cmd = tokio::process::Command::new(bin.join("postgres"));
    cmd.arg("-D").arg(&data).args(["-p", &a.port.to_string()]);
    let settings = [
        format!("listen_addresses={}", a.host),
        "unix_socket_directories=".into(),
        "fsync=on".into(),
        "synchronous_commit=on".into(),
        "full_page_writes=on".into(),
        format!("max_wal_size={}MB", a.max_wal_size_mb),
        format!("checkpoint_timeout={}s", a.checkpoint_timeout_s),
        format!("shared_buffers={}MB", a.shared_buffers_mb),
        "log_checkpoints=on".into(),
    ];
    for s in settings.iter().chain(&a.set) {
        anyhow::ensure!(s.contains('='), "--set {s:?}: expected NAME=VALUE");
        cmd.arg("-c").arg(s);
    }
    cmd.uid(uid).gid(gid).current_dir(&data).stdin(Stdio::null()).kill_on_drop(false);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut child = cmd.spawn().context("cannot start postgres")?;
        let pid = child.id().unwrap_or(0);
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        loop {
            tokio::select! {
                s = child.wait() => {
                    let s = s?;
                    anyhow::ensure!(s.success(), "postgres exited: {s}");
                    eprintln!("understudy failover postgres: stopped cleanly");
                    return Ok(());
                }
                _ = term.recv() => { crate::proc::signal(pid, libc::SIGINT); }
                _ = int.recv() => { crate::proc::signal(pid, libc::SIGINT); }
            }
        }
    })
}

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
