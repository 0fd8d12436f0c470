//! The configuration manager's server: runs [`CmCore`] with its durable state file and one
//! heartbeat link per node.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::leaderless::core::cm::{CmCore, CmInput, CmOutput, CmParams};
use crate::leaderless::proto::*;
use crate::pmlog::{self, LogRecord};

use super::*;

#[derive(Clone, Debug)]
pub struct CmConfig {
    pub params: CmParams,
    pub nodes: BTreeMap<NodeId, SocketAddr>,
    pub data_dir: PathBuf,
    pub secret: Vec<u8>,
    pub metrics: Option<SocketAddr>,
}

pub(super) fn load_cm_state(path: &Path) -> Result<Option<Config>, KvError> {
    match std::fs::read(path) {
        Ok(b) => {
            let (recs, _) = pmlog::decode_all(&b);
            // The state file holds one record: a Put whose value is the postcard configuration.
            for r in recs {
                if let LogRecord::Put { value, .. } = r {
                    return postcard::from_bytes(&value).map(Some).map_err(|e| {
                        KvError::Refused(format!("corrupt CM state {}: {e}", path.display()))
                    });
                }
            }
            Err(KvError::Refused(format!(
                "corrupt CM state {}: no record",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn save_cm_state(path: &Path, c: &Config) -> Result<(), KvError> {
    use std::io::Write;
    let rec = LogRecord::Put {
        key: b"config".to_vec(),
        ts: Ts::default(),
        value: postcard::to_allocvec(c).expect("config encodes"),
    };
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&pmlog::encode(&rec))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Runs the configuration manager until the process is stopped.
pub async fn run_cm(cfg: CmConfig) -> Result<(), KvError> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let state_path = cfg.data_dir.join("cm.state");
    let durable = load_cm_state(&state_path)?;
    if let Some(c) = &durable {
        tracing::info!(
            epoch = c.epoch,
            "CM restarting from its durable configuration"
        );
    }
    let start = Instant::now();
    let now_us = || start.elapsed().as_micros() as u64;
    let mut cm = CmCore::new(
        cfg.params.clone(),
        durable,
        cfg.nodes.len() as u32,
        now_us(),
    );
    let (ack_tx, mut ack_rx) = mpsc::channel::<HeartbeatAck>(65_536);
    let mut hb_tx: HashMap<NodeId, mpsc::Sender<Heartbeat>> = HashMap::new();
    for (&id, &addr) in &cfg.nodes {
        let (tx, rx) = mpsc::channel(64);
        hb_tx.insert(id, tx);
        tokio::spawn(cm_link(addr, cfg.secret.clone(), rx, ack_tx.clone()));
    }
    let epoch = Arc::new(AtomicU64::new(0));
    if let Some(m) = cfg.metrics {
        let l = TcpListener::bind(m).await?;
        let epoch = epoch.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let e = epoch.load(Ordering::Relaxed);
            async move {
                let mut out = String::new();
                wire::metrics::metric(
                    &mut out,
                    "kv_cm_epoch",
                    "gauge",
                    "configuration epoch",
                    &[("", e as f64)],
                );
                out
            }
        }));
    }
    let mut tick = tokio::time::interval(Duration::from_micros(
        cfg.params.heartbeat_interval_us.max(1000),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => cm.handle(now_us(), CmInput::Tick),
            Some(a) = ack_rx.recv() => cm.handle(now_us(), CmInput::Ack(a)),
        }
        for o in cm.take_outputs() {
            match o {
                CmOutput::Persist(c) => {
                    save_cm_state(&state_path, &c)?;
                    epoch.store(c.epoch, Ordering::Relaxed);
                }
                CmOutput::Send { to, hb } => {
                    if let Some(tx) = hb_tx.get(&to) {
                        let _ = tx.try_send(hb);
                    }
                }
                CmOutput::Note(n) => {
                    tracing::info!("{n}");
                    eprintln!("cm: {n}");
                }
            }
        }
    }
}

pub(super) async fn cm_link(
    addr: SocketAddr,
    secret: Vec<u8>,
    mut rx: mpsc::Receiver<Heartbeat>,
    acks: mpsc::Sender<HeartbeatAck>,
) {
    loop {
        let conn = dial(addr, &secret, Hello::Cm, None);
        let s = match tokio::time::timeout(Duration::from_secs(1), conn).await {
            Ok(Ok(s)) => s,
            _ => {
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let (mut r, mut w) = s.into_split();
        let acks2 = acks.clone();
        let reader = tokio::spawn(async move {
            while let Ok(NetMsg::HbAck(a)) =
                wire::read_msg::<NetMsg, _>(&mut r, MAX_FRAME_BYTES).await
            {
                if acks2.send(a).await.is_err() {
                    return;
                }
            }
        });
        loop {
            tokio::select! {
                m = rx.recv() => {
                    let Some(hb) = m else { reader.abort(); return };
                    if wire::write_msg(&mut w, &NetMsg::Hb(hb)).await.is_err() { break; }
                    // Over TLS the heartbeat's record may wait in the session until a flush.
                    if tokio::io::AsyncWriteExt::flush(&mut w).await.is_err() { break; }
                }
                _ = tokio::time::sleep(Duration::from_secs(1)), if reader.is_finished() => break,
            }
            if reader.is_finished() {
                break;
            }
        }
        reader.abort();
    }
}
