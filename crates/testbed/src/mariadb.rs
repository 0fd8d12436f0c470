//! `understudy failover mariadb`: runs Debian's unmodified MariaDB server (`mariadbd`) as an
//! instance's application, with the RocksDB storage engine (MyRocks) as the default engine when
//! its plugin is installed.
//!
//! The data directory lives on the instance's volume. On the first start it is made with
//! `mariadb-install-db` (root with an empty password on loopback only) into a scratch directory
//! renamed into place, so a crash during it leaves nothing half made. `mariadbd` drops to the
//! `mysql` user itself and shuts down cleanly on SIGTERM; like every process the instance's
//! application starts, it is in the application's cgroup, which the pool's kill empties
//! ([`failover::pool::unit`]). Commits are flushed at commit
//! (`rocksdb_flush_log_at_trx_commit = 1`, `innodb_flush_log_at_trx_commit = 1`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
pub struct MariaArgs {
    /// The data directory (made with mariadb-install-db when it holds no database yet).
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    /// TCP port.
    #[arg(long)]
    pub port: u16,
    /// Address to listen on (an instance's pool sets UNDERSTUDY_HOST: its namespace's address).
    #[arg(long, env = "UNDERSTUDY_HOST", default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// The unprivileged user mariadbd runs as.
    #[arg(long, default_value = "mysql")]
    pub user: String,
    /// Use InnoDB even when the RocksDB plugin is installed.
    #[arg(long)]
    pub innodb: bool,
    /// More `--NAME=VALUE` server options.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
}

const MARIADBD: &str = "/usr/sbin/mariadbd";
const ROCKSDB_PLUGIN: &str = "ha_rocksdb.so";

/// Whether the RocksDB plugin of Debian's mariadb-plugin-rocksdb is there.
pub fn rocksdb_plugin() -> bool {
    std::fs::read_dir("/usr/lib/mysql/plugin").is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.file_name() == ROCKSDB_PLUGIN)))
}

pub fn run(a: MariaArgs) -> anyhow::Result<()> {
    anyhow::ensure!(std::path::Path::new(MARIADBD).exists(), "MariaDB is not installed ({MARIADBD}): apt-get install mariadb-server");
    let (uid, gid) = crate::datadir::lookup_user(&a.user)?;
    let (data, parent) = crate::datadir::reachable_by(&a.data, &a.user, uid, gid)?;
    if !data.join("mysql").exists() {
        crate::datadir::make_in_scratch(&data, &parent, "install", "MariaDB database", (uid, gid), None, |scratch| {
            eprintln!("understudy failover mariadb: mariadb-install-db {} as {}", data.display(), a.user);
            let out = std::process::Command::new("mariadb-install-db")
                .arg(format!("--user={}", a.user))
                .arg(format!("--datadir={}", scratch.display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db", "--no-defaults"])
                .stdin(Stdio::null())
                .output()
                .context("cannot run mariadb-install-db")?;
            anyhow::ensure!(out.status.success(), "mariadb-install-db failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            Ok(())
        })?;
    }
    let mut cmd = std::process::Command::new(MARIADBD);
    cmd.arg("--no-defaults")
        .arg(format!("--user={}", a.user))
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--port={}", a.port))
        .arg(format!("--bind-address={}", a.host))
        // Unix socket paths are short (108 bytes): keep it out of the deep mount path.
        .arg(format!("--socket=/tmp/understudy-mariadb-{}.sock", a.port))
        .arg(format!("--pid-file={}/mariadbd.pid", data.display()))
        .arg("--innodb-flush-log-at-trx-commit=1")
        .arg("--skip-log-bin");
    if let std::net::IpAddr::V4(v4) = a.host {
        if !v4.is_loopback() {
            // Clients come over the instance's own link (a /30 in its network namespace), not
            // from localhost: let root in from that link too, as from localhost (empty password).
            let net = std::net::Ipv4Addr::from(u32::from(v4) & !3);
            let init = format!("/tmp/understudy-mariadb-{}-init.sql", a.port);
            let user = format!("'root'@'{net}/255.255.255.252'");
            std::fs::write(&init, format!("CREATE USER IF NOT EXISTS {user};\nGRANT ALL PRIVILEGES ON *.* TO {user} WITH GRANT OPTION;\n"))?;
            std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o644))?;
            cmd.arg(format!("--init-file={init}"));
        }
    }
    if !a.innodb && rocksdb_plugin() {
        cmd.arg(format!("--plugin-load-add={ROCKSDB_PLUGIN}")).arg("--default-storage-engine=ROCKSDB").arg("--rocksdb-flush-log-at-trx-commit=1");
    }
    for s in &a.set {
        anyhow::ensure!(s.contains('='), "--set {s:?}: expected NAME=VALUE");
        cmd.arg(format!("--{s}"));
    }
    // exec: mariadbd keeps this process id (the pool's app pid), and handles SIGTERM itself.
    let e = cmd.current_dir(&data).stdin(Stdio::null()).exec();
    Err(anyhow::Error::from(e).context("cannot start mariadbd"))
}
