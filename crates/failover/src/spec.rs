//! The failover spec: which application to run on which volume, how to check its health, where
//! clients connect, and the monitor's policy. TOML (`.toml`) or JSON (anything else).
//!
//! ```toml
//! volume = "db"
//! state_dir = "/var/lib/understudy/failover/db"   # journal, mounts, logs
//!
//! [app]
//! command = ["python3", "front.py", "--db", "{mount}/app.db", "--port", "{port}"]
//! env = { PYTHONUNBUFFERED = "1" }
//!
//! [health]
//! send = "PING"          # a read-only request, one line
//! expect = "PONG"        # the reply must start with this
//! timeout_ms = 1000
//!
//! [endpoint]
//! listen = "127.0.0.1:6000"
//!
//! [monitor]
//! policy = "speculative"
//! reds_timeout_ms = 60000
//!
//! [network]
//! namespaces = "auto"    # each instance in its own network namespace: auto, on, off
//! ```
//!
//! In `command`, `env` values and the health `command`: `{mount}` is the instance's mount
//! directory, `{port}` the TCP port the application must listen on (each instance gets its own),
//! `{host}` the address it must listen on (its namespace's address, or 127.0.0.1 without
//! namespaces; also in `UNDERSTUDY_HOST`), `{instance}` the instance id.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::proto::MonitorConfig;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// The volume the first primary runs on (it must exist; hold a file system unless `mkfs`).
    pub volume: String,
    /// Where the monitor keeps its journal, the instances' mount points and logs.
    pub state_dir: PathBuf,
    /// Make a fresh ext4 file system on the volume before the first primary starts.
    #[serde(default)]
    pub mkfs: bool,
    pub app: AppSpec,
    pub health: HealthSpec,
    pub endpoint: EndpointSpec,
    #[serde(default)]
    pub monitor: MonitorConfig,
    #[serde(default)]
    pub network: NetworkSpec,
}

/// Where instances live on the network.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Each instance's application in its own network namespace (Linux, root), reached over a
    /// veth pair, so a network cut-off takes its link down while its disk stays attached.
    /// `auto` (default): when running as root and `ip netns` works, else off with a message.
    #[serde(default)]
    pub namespaces: crate::netns::NetnsMode,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AppSpec {
    /// Program and arguments (no shell).
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How long a clean stop waits after SIGTERM before SIGKILL.
    #[serde(default = "default_stop_grace_ms")]
    pub stop_grace_ms: u64,
}

fn default_stop_grace_ms() -> u64 {
    10_000
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// One line sent over TCP to the instance (a read-only query) ...
    #[serde(default)]
    pub send: Option<String>,
    /// ... whose reply line must start with this. Without `send`/`command`: a TCP connect.
    #[serde(default)]
    pub expect: Option<String>,
    /// Or a command that exits 0 when healthy (e.g. `["pg_isready", "-p", "{port}"]`).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// Or speak PostgreSQL's protocol: connect, run `send` (default `SELECT 1`, read-only) and,
    /// with `expect`, check that the first column of the first row starts with it.
    #[serde(default)]
    pub postgres: Option<PgTarget>,
    /// Or speak MySQL/MariaDB's protocol the same way (user with an empty password).
    #[serde(default)]
    pub mysql: Option<MyTarget>,
    #[serde(default = "default_health_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_health_timeout_ms() -> u64 {
    1_000
}

/// Who a PostgreSQL client logs in as (trust authentication).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PgTarget {
    #[serde(default = "default_pg_user")]
    pub user: String,
    #[serde(default = "default_pg_user")]
    pub database: String,
}

fn default_pg_user() -> String {
    "postgres".into()
}

impl Default for PgTarget {
    fn default() -> Self {
        PgTarget { user: default_pg_user(), database: default_pg_user() }
    }
}

/// Who a MySQL/MariaDB client logs in as (empty password).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MyTarget {
    #[serde(default = "default_my_user")]
    pub user: String,
}

fn default_my_user() -> String {
    "root".into()
}

impl Default for MyTarget {
    fn default() -> Self {
        MyTarget { user: default_my_user() }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// The stable address clients use.
    pub listen: SocketAddr,
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read the spec {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid spec {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("invalid spec {path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
}

/// Largest spec file read (a spec is a few hundred bytes).
pub const MAX_SPEC_BYTES: u64 = 1 << 20;

impl Spec {
    pub fn load(path: &Path) -> Result<Spec, SpecError> {
        let read = |source| SpecError::Read { path: path.to_path_buf(), source };
        let meta = std::fs::metadata(path).map_err(read)?;
        if meta.len() > MAX_SPEC_BYTES {
            return Err(SpecError::Invalid { path: path.into(), msg: format!("larger than {MAX_SPEC_BYTES} bytes") });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        let spec: Spec = if path.extension().is_some_and(|e| e == "toml") {
            toml::from_str(&text).map_err(|e| SpecError::Parse { path: path.into(), msg: e.to_string() })?
        } else {
            serde_json::from_str(&text).map_err(|e| SpecError::Parse { path: path.into(), msg: e.to_string() })?
        };
        spec.validate().map_err(|msg| SpecError::Invalid { path: path.into(), msg })?;
        Ok(spec)
    }

    /// Checks what can be checked without the cluster: the command exists, limits are sane.
    pub fn validate(&self) -> Result<(), String> {
        if self.volume.is_empty() {
            return Err("`volume` is empty".into());
        }
        let Some(program) = self.app.command.first() else {
            return Err("`app.command` is empty: give the program and its arguments".into());
        };
        if find_program(program).is_none() {
            return Err(format!("`app.command`: program {program:?} not found (not a file, not on PATH)"));
        }
        if let Some(c) = &self.health.command {
            let Some(p) = c.first() else { return Err("`health.command` is empty".into()) };
            if find_program(p).is_none() {
                return Err(format!("`health.command`: program {p:?} not found"));
            }
            if self.health.send.is_some() {
                return Err("`health`: give either `command` or `send`, not both".into());
            }
        }
        let kinds = [self.health.command.is_some(), self.health.postgres.is_some(), self.health.mysql.is_some()];
        if kinds.iter().filter(|k| **k).count() > 1 {
            return Err("`health`: give one of `command`, `postgres` and `mysql`".into());
        }
        if self.health.expect.is_some() && self.health.send.is_none() && self.health.postgres.is_none() && self.health.mysql.is_none() {
            return Err("`health.expect` needs `health.send`".into());
        }
        let m = &self.monitor;
        let check = |ok: bool, what: &str| if ok { Ok(()) } else { Err(format!("`monitor.{what}`")) };
        check((10..=600_000).contains(&m.ping_interval_ms), "ping_interval_ms must be 10 to 600000")?;
        check(m.reds_timeout_ms >= m.ping_interval_ms, "reds_timeout_ms must be at least ping_interval_ms")?;
        check((1..=100).contains(&m.max_backup_starts), "max_backup_starts must be 1 to 100")?;
        check((1..=100).contains(&m.max_aborts), "max_aborts must be 1 to 100")?;
        check(m.healthy_timeout_ms >= 100, "healthy_timeout_ms must be at least 100")?;
        check(m.speculate_after_missed_pings >= 1, "speculate_after_missed_pings must be at least 1")?;
        if !(10..=600_000).contains(&self.health.timeout_ms) {
            return Err("`health.timeout_ms` must be 10 to 600000".into());
        }
        Ok(())
    }
}

/// The program as run: a path with a '/', or found on PATH.
pub fn find_program(p: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let exec = |path: &Path| std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if p.contains('/') {
        let path = PathBuf::from(p);
        return exec(&path).then_some(path);
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(p)).find(|c| exec(c))
}

/// Substitutes `{mount}`, `{port}`, `{host}` and `{instance}`.
pub fn substitute(s: &str, mount: &Path, host: std::net::IpAddr, port: u16, instance: &str) -> String {
    s.replace("{mount}", &mount.to_string_lossy())
        .replace("{port}", &port.to_string())
        .replace("{host}", &host.to_string())
        .replace("{instance}", instance)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const GOOD: &str = r#"
volume = "db"
state_dir = "/tmp/x"
[app]
command = ["python3", "-c", "pass"]
[health]
send = "PING"
expect = "PONG"
[endpoint]
listen = "127.0.0.1:6000"
[monitor]
policy = "reds"
reds_timeout_ms = 5000
"#;

    #[test]
    fn toml_and_json_parse() {
        let d = tempfile::tempdir().unwrap();
        let s = Spec::load(&write(d.path(), "a.toml", GOOD)).unwrap();
        assert_eq!(s.monitor.policy, crate::PolicyKind::Reds);
        assert_eq!(s.monitor.ping_interval_ms, MonitorConfig::default().ping_interval_ms);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(Spec::load(&write(d.path(), "a.json", &json)).unwrap(), s);
    }

    #[test]
    fn bad_specs_get_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            (GOOD.replace("python3", "no-such-program-xyz"), "not found"),
            (GOOD.replace("volume = \"db\"", ""), "missing field `volume`"),
            (GOOD.replace("[\"python3\", \"-c\", \"pass\"]", "[]"), "`app.command` is empty"),
            (GOOD.replace("reds_timeout_ms = 5000", "reds_timeout_ms = 1"), "reds_timeout_ms"),
            (GOOD.replace("policy = \"reds\"", "policy = \"magic\""), "unknown variant"),
            (GOOD.replace("[monitor]", "[monitor]\nbogus = 1"), "unknown field"),
            (format!("{GOOD}\n[network]\nnamespaces = \"maybe\""), "unknown variant"),
        ];
        for (text, want) in cases {
            let e = Spec::load(&write(d.path(), "b.toml", &text)).unwrap_err().to_string();
            assert!(e.contains(want), "{e} should mention {want}");
        }
        let e = Spec::load(&d.path().join("missing.toml")).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
    }
}
