//! A local witness-KV group (CANDStore): the primary (node 0), the backups (1..=B) and the
//! witnesses as child processes of this one, what `understudy kv up --protocol witness` runs.
//!
//! Layout of DIR: `secret`, `kv-cluster.json` (with `"protocol": "witness"`, which is how
//! `kv get/put` pick the witness client), `pids`, `node-N/` (SSD logs), `logs/node-N.log`; the
//! emulated NVMM of node N is `/dev/shm/understudy-witness-<DIR hash>/node-N` and is removed
//! by [`LocalWitnessKv::stop`] (it is RAM: a group left behind would hold it until reboot).
//! No supervisor restarts nodes yet: a killed primary is replaced by a witness's election,
//! and the dead node stays down; with `--spares` a spare takes a lost member's seat (the
//! leader's automatic membership policy, `core/reconfig.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use ::kv::witness::driver::WitnessClient;

use crate::cluster_file;
use crate::kv::{UpArgs, CLUSTER_FILE, PIDS_FILE};
use crate::proc;

/// What `kv-cluster.json` holds for a witness group.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WitnessClusterFile {
    /// Always "witness".
    pub protocol: String,
    pub backups: u32,
    /// Spare backups, then spare witnesses: the last nodes (see `kv node --spares`).
    #[serde(default)]
    pub spare_backups: u32,
    #[serde(default)]
    pub spares: u32,
    pub nodes: BTreeMap<u32, SocketAddr>,
    pub secret_file: PathBuf,
}

impl WitnessClusterFile {
    /// Reads `path` if it describes a witness group (`None` for a HEAL group's file).
    pub fn load(path: &Path) -> anyhow::Result<Option<(WitnessClusterFile, Vec<u8>)>> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} (start a group with `understudy kv up`, or pass --cluster)", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not a kv cluster file", path.display()))?;
        if v.get("protocol").and_then(|p| p.as_str()) != Some("witness") {
            return Ok(None);
        }
        let f: WitnessClusterFile = serde_json::from_value(v).with_context(|| format!("{} is not a witness cluster file", path.display()))?;
        let secret = cluster_file::read_secret(&f.secret_file)?;
        Ok(Some((f, secret)))
    }
    pub fn client(&self, secret: Vec<u8>) -> WitnessClient {
        WitnessClient::new(self.nodes.clone(), secret)
    }
}

/// The nodes' election timeout: twice the node default, so a loaded shared machine's scheduling
/// stalls do not look like a dead primary.
pub const ELECTION_TIMEOUT_MS: u64 = 300;

pub struct LocalWitnessKv {
    pub dir: PathBuf,
    pub file: WitnessClusterFile,
    pub secret: Vec<u8>,
    pub pmem_root: PathBuf,
    node_args: Vec<Vec<String>>,
    pub children: Vec<Option<Child>>,
}

impl LocalWitnessKv {
    pub fn start(a: &UpArgs) -> anyhow::Result<LocalWitnessKv> {
        anyhow::ensure!(a.backups >= 1 && a.witnesses >= 1, "a witness group needs at least one backup and one witness");
        let members = 1 + a.backups + a.witnesses;
        let n = members + a.spare_backups + a.spares;
        let recovery = a.recovery.witness()?;
        anyhow::ensure!(n <= 16, "at most 16 nodes");
        let dir = a.dir.clone();
        std::fs::create_dir_all(dir.join("logs")).with_context(|| format!("cannot create {}", dir.display()))?;
        let dir = dir.canonicalize()?;
        let secret_file = dir.join("secret");
        cluster_file::ensure_secret(&secret_file)?;
        let secret = cluster_file::read_secret(&secret_file)?;
        let cf = dir.join(CLUSTER_FILE);
        let nodes: BTreeMap<u32, SocketAddr> = match WitnessClusterFile::load(&cf) {
            Ok(Some((f, _)))
                if f.nodes.len() == n as usize
                    && (f.backups, f.spare_backups, f.spares) == (a.backups, a.spare_backups, a.spares) =>
            {
                f.nodes
            }
            _ => {
                let ports: Vec<u16> = if a.port_base == 0 {
                    wire::ports::free_loopback_ports(n as usize)?
                } else {
                    (0..n as u16).map(|i| a.port_base + i).collect()
                };
                (0..n).map(|i| (i, SocketAddr::from(([127, 0, 0, 1], ports[i as usize])))).collect()
            }
        };
        let file = WitnessClusterFile {
            protocol: "witness".into(),
            backups: a.backups,
            spare_backups: a.spare_backups,
            spares: a.spares,
            nodes: nodes.clone(),
            secret_file: secret_file.clone(),
        };
        let tmp = cf.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&file)?)?;
        std::fs::rename(&tmp, &cf)?;
        let hash = dir.to_string_lossy().bytes().fold(0x811c_9dc5u32, |h, x| (h ^ x as u32).wrapping_mul(0x0100_0193));
        let pmem_root = PathBuf::from("/dev/shm").join(format!("understudy-witness-{hash:08x}"));
        let peers: String = nodes.iter().map(|(i, a)| format!("{i}={a}")).collect::<Vec<_>>().join(",");
        let node_args = (0..n)
            .map(|i| {
                let backup = (1..=a.backups).contains(&i) || (members..members + a.spare_backups).contains(&i);
                let role = if backup { "backup" } else { "head" };
                let mut v: Vec<String> = vec![
                    "kv".into(), "node".into(), "--protocol".into(), "witness".into(),
                    "--role".into(), role.into(), "--backups".into(), a.backups.to_string(),
                    "--id".into(), i.to_string(), "--peers".into(), peers.clone(),
                    "--data".into(), dir.join(format!("node-{i}")).to_string_lossy().into_owned(),
                    "--pmem-dir".into(), pmem_root.join(format!("node-{i}")).to_string_lossy().into_owned(),
                    "--secret-file".into(), secret_file.to_string_lossy().into_owned(),
                    "--election-timeout-ms".into(), ELECTION_TIMEOUT_MS.to_string(),
                    "--spares".into(), a.spares.to_string(), "--spare-backups".into(), a.spare_backups.to_string(),
                ];
                if let Some(ms) = a.soft_timeout_ms {
                    v.extend(["--soft-timeout-ms".into(), ms.to_string()]);
                }
                if let Some(p) = a.sample_probability {
                    v.extend(["--sample-probability".into(), p.to_string()]);
                }
                v.extend(["--recovery".into(), recovery.name().into()]);
                v
            })
            .collect();
        let mut me = LocalWitnessKv { dir, file, secret, pmem_root, node_args, children: Vec::new() };
        for i in 0..n as usize {
            let c = proc::spawn_self(&me.node_args[i], &me.dir.join(format!("logs/node-{i}.log")), &[])?;
            me.children.push(Some(c));
        }
        me.write_pids()?;
        Ok(me)
    }

    /// Waits until a put and a get of a probe key succeed through the leader-following client.
    pub async fn wait_serving(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let mut c = self.file.client(self.secret.clone());
        c.deadline = timeout;
        c.put(b"__understudy_probe", b"1").await.context("the group did not start serving")?;
        anyhow::ensure!(c.get(b"__understudy_probe").await?.as_deref() == Some(&b"1"[..]), "the probe key read back wrong");
        Ok(t0.elapsed())
    }

    /// Kills node `i` with SIGKILL and reaps it.
    pub fn kill9(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut c) = self.children[i].take() {
            c.kill()?;
            c.wait()?;
        }
        self.write_pids()
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.children[i].as_ref().map(|c| c.id())
    }

    /// Notes for nodes that exited by themselves (reaped; not restarted).
    pub fn reap(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        for (i, c) in self.children.iter_mut().enumerate() {
            if let Some(ch) = c {
                if let Ok(Some(st)) = ch.try_wait() {
                    notes.push(format!("node-{i} exited ({st}); see {}/logs/node-{i}.log", self.dir.display()));
                    *c = None;
                }
            }
        }
        notes
    }

    pub fn write_pids(&self) -> anyhow::Result<()> {
        let text: String = self
            .children
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| format!("node-{i} {}\n", c.id())))
            .collect();
        let p = self.dir.join(PIDS_FILE);
        std::fs::write(p.with_extension("tmp"), text)?;
        std::fs::rename(p.with_extension("tmp"), p)?;
        Ok(())
    }

    /// Stops every node (SIGTERM, then SIGKILL) and removes the group's NVMM files.
    pub fn stop(&mut self) {
        let mut live: Vec<(String, Child)> =
            self.children.iter_mut().enumerate().filter_map(|(i, c)| c.take().map(|c| (format!("node-{i}"), c))).collect();
        proc::stop_children(&mut live, Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&self.pmem_root);
        let _ = std::fs::remove_file(self.dir.join(PIDS_FILE));
    }
}

impl Drop for LocalWitnessKv {
    fn drop(&mut self) {
        self.stop();
    }
}
