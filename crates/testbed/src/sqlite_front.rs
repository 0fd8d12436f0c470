//! The SQLite front (`understudy failover sqlite-front`): python3's sqlite3 module behind a line
//! protocol on TCP, the bundled test application of failover (WAL mode, synchronous=FULL).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
pub struct FrontArgs {
    #[arg(long)]
    pub db: PathBuf,
    #[arg(long)]
    pub port: u16,
    /// Address to listen on (an instance's pool sets UNDERSTUDY_HOST: its namespace's address).
    #[arg(long, env = "UNDERSTUDY_HOST", default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Write on its own every N ms (0: never), reachable or not.
    #[arg(long, default_value_t = 0)]
    pub housekeeping_ms: u64,
    /// WAL pages before SQLite checkpoints on its own (0: never): how much WAL a crash leaves.
    #[arg(long, default_value_t = 1000)]
    pub wal_autocheckpoint_pages: u64,
    /// A file with a number of milliseconds to spend after opening the database and before
    /// serving (a recovery of that length; benchmarks vary it per failure). Missing: none.
    #[arg(long, value_name = "FILE")]
    pub startup_delay_file: Option<PathBuf>,
}

/// Replaces this process with the front (exec), so signals reach it directly.
pub fn run(a: FrontArgs) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let python = ::failover::spec::find_program("python3").context("python3 not found (the SQLite front runs on python3's sqlite3 module)")?;
    // exec: the front keeps this process id, so signals reach it directly.
    // -I -S: the standard library only (no site-packages, whose .pth imports cost ~0.1 s of
    // every start, a failover's included; no current directory — the volume — on sys.path).
    let e = std::process::Command::new(python)
        .args(["-I", "-S"])
        .arg("-c")
        .arg(::failover::load::SQLITE_FRONT_PY)
        .arg("--db")
        .arg(&a.db)
        .arg("--port")
        .arg(a.port.to_string())
        .arg("--host")
        .arg(a.host.to_string())
        .arg("--housekeeping-ms")
        .arg(a.housekeeping_ms.to_string())
        .arg("--wal-autocheckpoint-pages")
        .arg(a.wal_autocheckpoint_pages.to_string())
        .arg("--startup-delay-file")
        .arg(a.startup_delay_file.unwrap_or_default())
        .exec();
    Err(anyhow::Error::from(e).context("cannot start python3"))
}
