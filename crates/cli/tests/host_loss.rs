//! Losing a whole machine (issue 24 items 7 and 9), on [`testbed::hostbed`]: three hosts
//! (network namespaces), each with an etcd member and one daemon of every kind bound to its own
//! address, and a client host for the test's clients. A host's loss is its link cut and every
//! process in it SIGKILLed: its peers hear nothing (no FIN, no RST), as when a machine dies.
//!
//! Root only (network namespaces): skipped otherwise, with a message.

use std::collections::BTreeMap;

use blockdev::BlockDev;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testbed::hostbed::{HostBed, ELECTION_TTL};
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp, META_ELECTION};

const BIN: &str = env!("CARGO_BIN_EXE_understudy");
/// The writer's block.
const BLOCK_BYTES: u64 = 4096;
const VOLUME_BYTES: u64 = 64 << 20;
/// Bound of a takeover after a host's death: the election lease, the store's own election
/// (etcd loses a member too) and a loaded machine's stalls, with room (a takeover is ~1-2 TTLs).
const TAKEOVER_BOUND: Duration = Duration::from_secs(20);
/// Bound of every other wait.
const WAIT: Duration = Duration::from_secs(30);

/// One bed at a time: each is 3 etcd members and 6+ daemons on a loaded 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn bed() -> Option<(std::sync::MutexGuard<'static, ()>, HostBed)> {
    if let Err(e) = testbed::hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Some((g, HostBed::start(BIN.as_ref()).expect("host bed with etcd")))
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

/// A tokio runtime whose threads are the calling thread's children: called in the client
/// host's namespace, every socket it opens is the client host's.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The host a leader named `prefix-hI` runs on.
fn host_of_name(name: &str) -> usize {
    name.rsplit_once("-h").and_then(|(_, i)| i.parse().ok()).unwrap_or_else(|| panic!("leader name {name} names no host"))
}

/// Polls the election `name` until it names a leader other than `not`; returns it and the time.
async fn wait_leader(store: &control::Store, name: &str, not: Option<&str>, timeout: Duration) -> (String, Duration) {
    let start = Instant::now();
    loop {
        if let Some(l) = store.observe(name).await.ok().flatten() {
            if Some(l.as_str()) != not {
                return (l, start.elapsed());
            }
        }
        assert!(start.elapsed() < timeout, "no leader of {name} other than {not:?} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pattern(offset: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES as usize];
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((offset / BLOCK_BYTES) as u8).wrapping_mul(31).wrapping_add(i as u8) | 1;
    }
    b
}

/// A client of whichever metadata service leads (a dead host's address costs a dial timeout).
async fn connect(metas: &str, secret: &[u8]) -> Arc<Cluster> {
    let deadline = Instant::now() + WAIT;
    loop {
        match Cluster::connect(metas, secret).await {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "no metadata service answered at {metas}: {e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Until the map lists `n` shards up.
async fn wait_shards_up(c: &Cluster, n: usize) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(MetaResp::Map(m)) = c.meta(MetaReq::GetMap).await {
            if m.shards.iter().filter(|s| s.state == volume::types::ShardState::Up).count() >= n {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{n} shards did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes each block of `vol` once, in order, recording the acknowledged ones with their time.
struct VolWriter {
    acked: Arc<Mutex<BTreeMap<u64, Instant>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl VolWriter {
    fn start(vol: Arc<volume::driver::client::Volume>) -> VolWriter {
        let acked: Arc<Mutex<BTreeMap<u64, Instant>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (acked, stop) = (acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut off = 0;
                while !stop.load(Ordering::Relaxed) && off < VOLUME_BYTES {
                    if vol.write(off, pattern(off)).await.is_ok() {
                        acked.lock().unwrap().insert(off, Instant::now());
                    }
                    off += BLOCK_BYTES;
                }
            })
        };
        VolWriter { acked, stop, task }
    }

    /// Stops the writer; every acknowledged block must read back through `c`.
    async fn finish_and_verify(self, c: &Arc<Cluster>, name: &str) -> BTreeMap<u64, Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let acked = self.acked.lock().unwrap().clone();
        let vol = c.open(name).await.unwrap();
        for &off in acked.keys() {
            assert_eq!(vol.read(off, BLOCK_BYTES as u32).await.unwrap(), pattern(off), "acknowledged block at {off} lost");
        }
        acked
    }
}

/// Item 7: the host of the metadata leader dies (with its shard and its etcd member) under a
/// verifying writer. A service on another host leads, create / super / collapse are served,
/// the writer goes on, and every acknowledged block reads back.
#[test]
fn losing_the_metadata_leaders_host() {
    let Some((_serial, bed)) = bed() else { return };
    bed.in_client(|| {
        let sys = bed.start_volume().unwrap();
        runtime().block_on(async {
            let store = control::Store::open(&bed.store_url(), "volume", &volume::driver::meta::cluster_id_from_secret(bed.secret())).await.unwrap();
            let (leader, _) = wait_leader(&store, META_ELECTION, None, WAIT).await;
            let c = connect(&sys.meta_list(), bed.secret()).await;
            wait_shards_up(&c, 3).await;
            c.meta(MetaReq::Create { name: "vol".into(), size_bytes: VOLUME_BYTES, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await.unwrap();
            let w = VolWriter::start(Arc::new(c.open("vol").await.unwrap()));
            tokio::time::sleep(Duration::from_millis(1500)).await;

            let lost = host_of_name(&leader);
            let load_at_kill = load();
            let killed = Instant::now();
            bed.kill_host(lost).unwrap();
            let (new_leader, takeover) = wait_leader(&store, META_ELECTION, Some(&leader), TAKEOVER_BOUND).await;
            assert_ne!(host_of_name(&new_leader), lost);
            // The next decision served: a create through the new leader (the client dials the list).
            let first_create = loop {
                let create = MetaReq::Create { name: "side".into(), size_bytes: 8 << 20, object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES };
                // Bounded: a request must not wait forever on the dead leader's connection.
                match tokio::time::timeout(WAIT, c.meta(create)).await.expect("a metadata request hung on the dead leader's connection") {
                    Ok(MetaResp::Volume(_)) => break killed.elapsed(),
                    r => {
                        assert!(killed.elapsed() < WAIT, "no create served after the takeover: {r:?}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            let side = c.open("side").await.unwrap();
            side.write(0, pattern(0)).await.unwrap();
            let r = c.meta(MetaReq::Super { parent: "side".into(), child: "side-c".into() }).await.unwrap();
            assert!(matches!(r, MetaResp::Volume(_)), "{r:?}");
            let r = c.collapse("side-c", WAIT).await.unwrap();
            assert!(matches!(r, MetaResp::Collapsed { .. }), "{r:?}");
            // The writer goes on after the takeover, then everything acknowledged reads back
            // through a fresh client.
            tokio::time::sleep(Duration::from_millis(2000)).await;
            let c2 = connect(&sys.meta_list(), bed.secret()).await;
            let acked = w.finish_and_verify(&c2, "vol").await;
            let after = acked.values().filter(|t| **t > killed + takeover).count();
            eprintln!(
                "meta leader's host lost: {new_leader} leads {} ms after (election TTL {} ms, ratio {:.2}); first create {} ms after; \
                 {} blocks acknowledged ({after} after the takeover), all read back; load {load_at_kill}",
                takeover.as_millis(),
                ELECTION_TTL.as_millis(),
                takeover.as_secs_f64() / ELECTION_TTL.as_secs_f64(),
                first_create.as_millis(),
                acked.len(),
            );
            assert!(after > 10, "too few writes acknowledged after the takeover: {after}");
        });
    })
    .unwrap();
}
