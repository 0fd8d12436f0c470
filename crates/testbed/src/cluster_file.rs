//! `cluster.json` (what `up` started and where) and the cluster secret file.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use volume::driver::client::Cluster;

pub const DEFAULT_DIR: &str = "./understudy-data";
pub const CLUSTER_FILE: &str = "cluster.json";
pub const SECRET_FILE: &str = "secret";
/// Random bytes in a generated secret (stored as hex).
const SECRET_BYTES: usize = 32;
/// How long a client command waits to reach and authenticate to the metadata service.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ProcInfo {
    pub addr: String,
    pub pid: u32,
    pub log: PathBuf,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ShardProc {
    pub id: u32,
    pub addr: String,
    pub dir: PathBuf,
    pub pid: u32,
    pub log: PathBuf,
    /// The shard's Prometheus endpoint, if it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct NbdProc {
    pub addr: String,
    /// `nbd://ADDR/<volume>`
    pub uri: String,
    pub unix_socket: PathBuf,
    pub pid: u32,
    pub log: PathBuf,
}

/// Everything a client (or a person) needs to use a cluster started by `understudy volume up`.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ClusterInfo {
    pub dir: PathBuf,
    pub secret_file: PathBuf,
    pub replicas: u32,
    pub port_base: u16,
    /// Pid of the `understudy volume up` process that supervises the others.
    pub up_pid: u32,
    pub meta: ProcInfo,
    pub nbd: NbdProc,
    pub shards: Vec<ShardProc>,
}

impl ClusterInfo {
    pub fn load(path: &Path) -> anyhow::Result<ClusterInfo> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read cluster file {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("{} is not a cluster file written by `understudy volume up`", path.display()))
    }

    /// Writes atomically (temp file, fsync, rename).
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let tmp = path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
        f.write_all(&serde_json::to_vec_pretty(self)?)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }

    pub fn nbd_uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.nbd.addr)
    }
}

/// Reads a cluster secret file: its contents, surrounding whitespace trimmed.
pub fn read_secret(path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read the cluster secret file {}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let secret = text.trim();
    anyhow::ensure!(!secret.is_empty(), "the cluster secret file {} is empty", path.display());
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            tracing::warn!("{} is readable by others: `chmod 600 {}`", path.display(), path.display());
        }
    }
    Ok(secret.as_bytes().to_vec())
}

/// Creates a random secret file (mode 0600) unless one exists.
pub fn ensure_secret(path: &Path) -> anyhow::Result<()> {
    if path.exists() {
        read_secret(path)?;
        return Ok(());
    }
    let bytes: [u8; SECRET_BYTES] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create the cluster secret file {}", path.display()))?;
    f.write_all(hex.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    Ok(())
}

/// The cluster secret for a client that needs only it (the failover control commands):
/// `--secret-file`, else the one the cluster file names (`--cluster`, else the default file).
pub fn resolve_secret(cluster: Option<&Path>, secret_file: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    if let Some(f) = secret_file {
        return read_secret(f);
    }
    let path = cluster.map(Path::to_path_buf).unwrap_or_else(|| Path::new(DEFAULT_DIR).join(CLUSTER_FILE));
    anyhow::ensure!(
        path.exists(),
        "no cluster file at {} to take the cluster secret from: pass --secret-file FILE or --cluster FILE (or $UNDERSTUDY_CLUSTER)",
        path.display()
    );
    read_secret(&ClusterInfo::load(&path)?.secret_file)
}

/// Where client commands find the cluster: the metadata address and the secret.
pub struct Target {
    pub meta_addr: String,
    pub secret: Vec<u8>,
    /// The cluster file, if one was used.
    pub info: Option<ClusterInfo>,
}

impl Target {
    /// From the client options: the cluster file (`--cluster`), else the default one, unless
    /// both the metadata address (`--meta`) and the secret file (`--secret-file`) are given.
    pub fn resolve(cluster: Option<&Path>, meta: Option<&str>, secret_file: Option<&Path>) -> anyhow::Result<Target> {
        let explicit = cluster.is_some();
        let path = cluster.map(Path::to_path_buf).unwrap_or_else(|| Path::new(DEFAULT_DIR).join(CLUSTER_FILE));
        let info = if meta.is_some() && secret_file.is_some() && !explicit {
            None
        } else if path.exists() || explicit {
            Some(ClusterInfo::load(&path)?)
        } else {
            anyhow::bail!(
                "no cluster file at {}: start a cluster with `understudy volume up`, or pass --cluster FILE \
                 (or $UNDERSTUDY_CLUSTER, or --meta ADDR --secret-file FILE)",
                path.display()
            );
        };
        let meta_addr = match (meta, &info) {
            (Some(m), _) => m.to_string(),
            (None, Some(i)) => i.meta.addr.clone(),
            (None, None) => unreachable!(),
        };
        let secret_file = match (secret_file, &info) {
            (Some(f), _) => f.to_path_buf(),
            (None, Some(i)) => i.secret_file.clone(),
            (None, None) => unreachable!(),
        };
        Ok(Target { meta_addr, secret: read_secret(&secret_file)?, info })
    }

    pub async fn connect(&self) -> anyhow::Result<Arc<Cluster>> {
        connect(&self.meta_addr, &self.secret).await
    }
}

/// Connects to the metadata service with a bounded wait and a hint on failure.
pub async fn connect(meta_addr: &str, secret: &[u8]) -> anyhow::Result<Arc<Cluster>> {
    match tokio::time::timeout(CONNECT_TIMEOUT, Cluster::connect(meta_addr, secret)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => {
            let text = format!("{e:#}");
            let hint = if text.contains("secret") {
                " (wrong cluster secret? check --secret-file or the cluster file)"
            } else if text.contains("refused") || text.contains("timed out") {
                " (is `understudy volume up` or `understudy volume meta` running?)"
            } else {
                ""
            };
            Err(anyhow::anyhow!("{text}{hint}"))
        }
        Err(_) => anyhow::bail!("the metadata service at {meta_addr} did not answer within {CONNECT_TIMEOUT:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_roundtrip_and_mode() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secret");
        ensure_secret(&p).unwrap();
        let s1 = read_secret(&p).unwrap();
        assert_eq!(s1.len(), SECRET_BYTES * 2);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        ensure_secret(&p).unwrap();
        assert_eq!(read_secret(&p).unwrap(), s1, "an existing secret is kept");
        std::fs::write(&p, "  \n").unwrap();
        assert!(read_secret(&p).is_err());
    }
}
