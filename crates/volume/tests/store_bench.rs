//! Latency of the shard's object store alone (`FileStore::run`), without network or replication:
//! a 4 KiB overwrite of an existing 64 KiB object, a 4 KiB copy-on-write into a new collocated
//! child object, and a 64 KiB whole-object `Put`, at depth 1 and with 32 threads — for the slot
//! store and, for comparison, the one-file-per-object store it replaced
//! (`store_bench/old_file_store.rs`, benchmark only). Both stores run in one process on the same
//! disk, batch by batch in ABBA order, so machine noise (other builds share the disk and its
//! cache flushes) hits them alike.
//!
//! Ignored by default (it is a measurement, not a check). Run in release on the work disk:
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-store cargo test --release -p volume --test store_bench \
//!     -- --ignored --nocapture
//! ```
//!
//! Knobs (environment): `STORE_BENCH_DIR` (default `/work/store-bench-<pid>`),
//! `STORE_BENCH_OPS` (operations per store, variant and depth; default 2000),
//! `STORE_BENCH_BATCH` (operations per batch, default 100), `STORE_BENCH_RECYCLE` (1, default:
//! the COW children of a batch are deleted after it, untimed, as garbage collection does after
//! `collapse`, so slots are recycled; 0: they are kept, so every COW write needs a never-used
//! slot and the refill must keep up), `STORE_BENCH_STORES` (`new,old,raw` by default; `new` is
//! the slot store as shards run it by default (every write syncs its slot file), `journal` the
//! slot store with its write-ahead journal (group commit), `raw` the device floor, see [`RawFiles`]).

#[path = "store_bench/old_file_store.rs"]
mod old_file_store;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rand::{Rng, SeedableRng};
use volume::core::shard::{DiskCmd, DiskErr, DiskOut};
use volume::store::FileStore;
use volume::types::{ObjKey, RepOp, Version};

const OBJECT_BYTES: usize = 64 * 1024;
const WRITE_BYTES: usize = 4096;
const PARENT_OBJECTS: u64 = 2048;
const TABLE: u64 = 1;
const PARENT: u64 = 1;
const DEPTHS: [usize; 2] = [1, 32];

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Overwrite,
    Cow,
    Put,
}

const VARIANTS: [Variant; 3] = [Variant::Overwrite, Variant::Cow, Variant::Put];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Overwrite => "overwrite 4KiB",
            Variant::Cow => "COW 4KiB",
            Variant::Put => "put 64KiB",
        }
    }
}

enum Store {
    New(FileStore),
    Old(old_file_store::OldFileStore),
    Raw(RawFiles),
}

/// The device floor: what each variant must at least do, on pre-written files kept open (no
/// lookups, no checksums, no index): an overwrite writes a header sector and its data; a COW
/// reads the parent's 64 KiB and writes header and bytes (68 KiB) to the child's file; a Put
/// writes 68 KiB. Each ends with one `fdatasync`.
struct RawFiles {
    parents: Vec<std::fs::File>,
    children: Vec<std::fs::File>,
}

const RAW_SLOT_BYTES: usize = 4096 + OBJECT_BYTES;

impl RawFiles {
    fn open(dir: &Path) -> RawFiles {
        use std::os::unix::fs::FileExt;
        std::fs::create_dir_all(dir).unwrap();
        let make = |name: String| {
            let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join(name)).unwrap();
            f.write_all_at(&vec![0u8; RAW_SLOT_BYTES], 0).unwrap();
            f.sync_all().unwrap();
            f
        };
        let parents = (0..PARENT_OBJECTS).map(|o| make(format!("p{o}"))).collect();
        let children = (0..PARENT_OBJECTS).map(|o| make(format!("c{o}"))).collect();
        std::fs::File::open(dir).unwrap().sync_all().unwrap();
        RawFiles { parents, children }
    }

    fn run(&self, cmd: DiskCmd) -> Result<DiskOut, DiskErr> {
        use std::os::unix::fs::FileExt;
        let io = |e: std::io::Error| DiskErr::Io(e.to_string());
        match cmd {
            DiskCmd::Apply { key, op: RepOp::Write { offset, data }, cow_from: None, .. } => {
                let f = &self.parents[key.objno as usize];
                f.write_all_at(&[1u8; 512], 0).map_err(io)?;
                f.write_all_at(&data, 4096 + offset as u64).map_err(io)?;
                f.sync_data().map_err(io)?;
            }
            DiskCmd::Apply { key, op: RepOp::Write { offset, data }, cow_from: Some(_), .. } => {
                let mut buf = vec![0u8; RAW_SLOT_BYTES];
                self.parents[key.objno as usize].read_exact_at(&mut buf[4096..], 4096).map_err(io)?;
                buf[4096 + offset as usize..4096 + offset as usize + data.len()].copy_from_slice(&data);
                let f = &self.children[key.objno as usize];
                f.write_all_at(&buf, 0).map_err(io)?;
                f.sync_data().map_err(io)?;
            }
            DiskCmd::Apply { key, op: RepOp::Put { data }, .. } => {
                let mut buf = vec![1u8; 4096];
                buf.extend_from_slice(&data);
                let f = &self.parents[key.objno as usize];
                f.write_all_at(&buf, 0).map_err(io)?;
                f.sync_data().map_err(io)?;
            }
            DiskCmd::Delete { .. } => {}
            cmd => panic!("the raw floor does not do {cmd:?}"),
        }
        Ok(DiskOut::Done)
    }
}

impl Store {
    fn open(kind: &str, dir: &Path) -> Store {
        match kind {
            "new" => {
                let s = FileStore::open(dir, true).unwrap();
                s.boot().unwrap();
                Store::New(s)
            }
            "journal" => {
                let pool = volume::store::PoolOptions { journal_capacity_bytes: Some(volume::store::DEFAULT_JOURNAL_BYTES), ..Default::default() };
                let s = FileStore::open_with(dir, true, pool).unwrap();
                s.boot().unwrap();
                Store::New(s)
            }
            "old" => {
                let s = old_file_store::OldFileStore::open(dir, true).unwrap();
                s.boot().unwrap();
                Store::Old(s)
            }
            "raw" => Store::Raw(RawFiles::open(dir)),
            k => panic!("unknown store {k} (new, journal, old or raw)"),
        }
    }

    fn run(&self, cmd: DiskCmd) -> Result<DiskOut, DiskErr> {
        match self {
            Store::New(s) => s.run(cmd),
            Store::Old(s) => s.run(cmd),
            Store::Raw(s) => s.run(cmd),
        }
    }
}

struct Bench {
    name: String,
    store: Store,
    seq: AtomicU64,
    /// Next child owner: each COW batch writes a fresh child of the parents.
    next_child: AtomicU64,
    recycle: bool,
}

impl Bench {
    fn version(&self) -> Version {
        Version { epoch: 1, seq: self.seq.fetch_add(1, Ordering::Relaxed) }
    }

    /// Runs a command; returns its latency in nanoseconds.
    fn run(&self, cmd: DiskCmd) -> u64 {
        let t = Instant::now();
        let r = self.store.run(cmd);
        let ns = t.elapsed().as_nanos() as u64;
        assert!(matches!(r, Ok(DiskOut::Done)), "{r:?}");
        ns
    }

    /// Runs one batch of `ops` operations of `variant` on `depth` threads (closed loop each);
    /// returns each operation's latency in nanoseconds.
    fn batch(&self, variant: Variant, ops: usize, depth: usize, seed: u64) -> Vec<u64> {
        let child = self.next_child.fetch_add(1, Ordering::Relaxed);
        // Distinct objects per batch (for COW: each a not-yet-copied child object); thread t takes
        // the objects ≡ t (mod depth), so no two threads touch one object at once.
        let mut objnos: Vec<u64> = (0..PARENT_OBJECTS).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        rand::seq::SliceRandom::shuffle(&mut objnos[..], &mut rng);
        assert!(ops <= PARENT_OBJECTS as usize);
        let objnos = &objnos[..ops];
        let mut lat = Vec::with_capacity(ops);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..depth)
                .map(|t| {
                    let mine: Vec<u64> = objnos.iter().copied().filter(|o| (*o as usize) % depth == t).collect();
                    s.spawn(move || {
                        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ ((t as u64 + 1) * 7919));
                        let mut lat = Vec::with_capacity(mine.len());
                        for objno in mine {
                            let offset = (rng.gen_range(0..OBJECT_BYTES / WRITE_BYTES) * WRITE_BYTES) as u32;
                            let data = vec![rng.gen::<u8>(); WRITE_BYTES];
                            let parent = ObjKey { table: TABLE, objno, owner: PARENT };
                            let cmd = match variant {
                                Variant::Overwrite => {
                                    DiskCmd::Apply { key: parent, version: self.version(), op: RepOp::Write { offset, data }, cow_from: None }
                                }
                                Variant::Cow => DiskCmd::Apply {
                                    key: ObjKey { owner: child, ..parent },
                                    version: self.version(),
                                    op: RepOp::Write { offset, data },
                                    cow_from: Some(parent),
                                },
                                Variant::Put => DiskCmd::Apply {
                                    key: parent,
                                    version: self.version(),
                                    op: RepOp::Put { data: vec![rng.gen::<u8>(); OBJECT_BYTES] },
                                    cow_from: None,
                                },
                            };
                            lat.push(self.run(cmd));
                        }
                        lat
                    })
                })
                .collect();
            for h in handles {
                lat.extend(h.join().unwrap());
            }
        });
        if variant == Variant::Cow && self.recycle {
            for &objno in objnos {
                self.store.run(DiskCmd::Delete { key: ObjKey { table: TABLE, objno, owner: child } }).unwrap();
            }
        }
        lat
    }
}

/// Mean, p50 and p99 in microseconds.
fn summary(lat: &mut [u64]) -> (f64, f64, f64) {
    lat.sort_unstable();
    let mean = lat.iter().sum::<u64>() as f64 / lat.len() as f64 / 1000.0;
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    (mean, p(0.5), p(0.99))
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture in release"]
fn store_latency() {
    let ops = env_usize("STORE_BENCH_OPS", 2000);
    let batch = env_usize("STORE_BENCH_BATCH", 100).min(ops);
    let recycle = env_usize("STORE_BENCH_RECYCLE", 1) != 0;
    let kinds: Vec<String> =
        std::env::var("STORE_BENCH_STORES").unwrap_or_else(|_| "new,old,raw".into()).split(',').map(String::from).collect();
    let dir = std::env::var("STORE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(format!("/work/store-bench-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir);
    let benches: Vec<Bench> = kinds
        .iter()
        .map(|k| Bench {
            name: k.clone(),
            store: Store::open(k, &dir.join(k)),
            seq: AtomicU64::new(1),
            next_child: AtomicU64::new(2),
            recycle,
        })
        .collect();
    for b in &benches {
        let t = Instant::now();
        for objno in 0..PARENT_OBJECTS {
            let data: Vec<u8> = (0..OBJECT_BYTES).map(|i| (i as u64 ^ objno) as u8).collect();
            b.run(DiskCmd::Apply {
                key: ObjKey { table: TABLE, objno, owner: PARENT },
                version: b.version(),
                op: RepOp::Put { data },
                cow_from: None,
            });
        }
        eprintln!("{}: setup of {PARENT_OBJECTS} objects of {OBJECT_BYTES} bytes in {:.1} s", b.name, t.elapsed().as_secs_f64());
    }
    println!("store latency: {ops} ops per point, batches of {batch}, recycle={recycle}, dir {}", dir.display());
    println!("{:>6} {:>15} {:>6} {:>9} {:>9} {:>9}", "store", "variant", "depth", "mean_us", "p50_us", "p99_us");
    // (store, variant) pairs, run in ABBA order.
    let pairs: Vec<(usize, usize)> = (0..benches.len()).flat_map(|b| (0..VARIANTS.len()).map(move |v| (b, v))).collect();
    for depth in DEPTHS {
        let mut lat: Vec<Vec<u64>> = vec![vec![]; pairs.len()];
        let mut round = 0u64;
        while lat[0].len() < ops {
            let n = batch.min(ops - lat[0].len());
            let mut order: Vec<usize> = (0..pairs.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let (b, v) = pairs[i];
                lat[i].extend(benches[b].batch(VARIANTS[v], n, depth, round * 31 + v as u64));
            }
            round += 1;
        }
        for (b, bench) in benches.iter().enumerate() {
            let mut stats = vec![];
            for (v, variant) in VARIANTS.iter().enumerate() {
                let i = pairs.iter().position(|p| *p == (b, v)).unwrap();
                let (mean, p50, p99) = summary(&mut lat[i]);
                stats.push((mean, p50, p99));
                println!("{:>6} {:>15} {:>6} {:>9.1} {:>9.1} {:>9.1}", bench.name, variant.name(), depth, mean, p50, p99);
            }
            println!(
                "{:>6} {:>15} {:>6} {:>9.2} {:>9.2} {:>9.2}",
                bench.name,
                "COW/overwrite",
                depth,
                stats[1].0 / stats[0].0,
                stats[1].1 / stats[0].1,
                stats[1].2 / stats[0].2
            );
            if let Store::New(s) = &bench.store {
                println!("{:>6} {:?}", bench.name, s.pool_stats());
                if let Some(j) = s.journal_stats() {
                    println!("{:>6} {:?}", bench.name, j);
                }
            }
        }
    }
    drop(benches);
    std::fs::remove_dir_all(&dir).unwrap();
}
