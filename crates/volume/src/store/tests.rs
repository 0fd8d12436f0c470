use super::*;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::time::Instant;

fn key(objno: u64, owner: u64) -> ObjKey {
    ObjKey { table: 7, objno, owner }
}

fn v(seq: u64) -> Version {
    Version { epoch: 1, seq }
}

/// No background refill: slot counts are exact.
fn quiet() -> PoolOptions {
    PoolOptions { background_refill: false, journal_capacity_bytes: Some(crate::store::journal::MIN_CAPACITY_BYTES), ..PoolOptions::default() }
}

fn no_journal() -> PoolOptions {
    PoolOptions { journal_capacity_bytes: None, ..quiet() }
}

fn write(s: &FileStore, k: ObjKey, seq: u64, offset: u32, data: Vec<u8>) {
    s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Write { offset, data }, cow_from: None }).unwrap();
}

fn read(s: &FileStore, k: ObjKey, offset: u32, len: u32) -> Vec<u8> {
    let DiskOut::Data(d) = s.run(DiskCmd::Read { key: k, offset, len }).unwrap() else { panic!() };
    d
}

fn read_all(s: &FileStore, k: ObjKey) -> Vec<u8> {
    let DiskOut::Data(d) = s.run(DiskCmd::ReadAll { key: k }).unwrap() else { panic!() };
    d
}

fn reopen_boot(dir: &Path) -> Boot {
    FileStore::open_with(dir, false, quiet()).unwrap().boot().unwrap()
}

/// The object a crash-test writer ([`journal_crash_writer`]) leaves after `seq` writes.
fn crash_model(objno: u64, seq: u64) -> Vec<u8> {
    let mut obj = vec![objno as u8; 65536];
    for s in 2..=seq {
        let at = (s as usize * 4096) % 65536;
        obj[at..at + 4096].fill((objno * 7 + s) as u8);
    }
    obj
}

const CRASH_DIR_ENV: &str = "UNDERSTUDY_JOURNAL_CRASH_DIR";
const CRASH_WRITERS: u64 = 6;
const CRASH_OBJECTS_PER_WRITER: u64 = 24;

/// Run as a child process by [`a_shard_store_killed_mid_burst_keeps_every_acknowledged_write`]
/// (does nothing otherwise): writers append to objects of their own, one write in flight
/// each, printing every acknowledged write, until the parent SIGKILLs the process.
#[test]
fn journal_crash_writer() {
    let Ok(dir) = std::env::var(CRASH_DIR_ENV) else { return };
    let s = Arc::new(FileStore::open_with(Path::new(&dir), true, quiet()).unwrap());
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..CRASH_WRITERS)
        .map(|t| {
            let (s, out) = (s.clone(), out.clone());
            std::thread::spawn(move || {
                for seq in 1u64.. {
                    for i in 0..CRASH_OBJECTS_PER_WRITER {
                        let objno = t * CRASH_OBJECTS_PER_WRITER + i;
                        let op = if seq == 1 {
                            RepOp::Put { data: crash_model(objno, 1) }
                        } else {
                            let at = (seq as usize * 4096) % 65536;
                            RepOp::Write { offset: at as u32, data: vec![(objno * 7 + seq) as u8; 4096] }
                        };
                        s.run(DiskCmd::Apply { key: key(objno, 1), version: v(seq), op, cow_from: None }).unwrap();
                        let mut o = out.lock().unwrap();
                        writeln!(o, "acked {objno} {seq}").unwrap();
                        o.flush().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A real process writing through the journal is SIGKILLed mid-burst. To stand for a power
/// loss (which SIGKILL is not: the page cache survives), every slot byte the journal's
/// records still cover is then overwritten with garbage — as if those writes never reached
/// the slot files — and a torn record is put at the journal's end. Reopened, the store must
/// hold every acknowledged write (and at most the one unacknowledged write per object that
/// was in flight), with no object suspect, and keep working. It failed about one run in six
/// while the journal was write-behind (a write in flight at the kill had bytes in its slot
/// and no record to redo them).
#[test]
fn a_shard_store_killed_mid_burst_keeps_every_acknowledged_write() {
    let dir = tempdir();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "store::tests::journal_crash_writer", "--nocapture", "--test-threads=1"])
        .env(CRASH_DIR_ENV, &dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let counted = count.clone();
    let reader = std::thread::spawn(move || {
        let mut acked: HashMap<u64, u64> = HashMap::new();
        let mut lines = 0;
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            let mut w = line.split_whitespace();
            if w.next() == Some("acked") {
                let objno: u64 = w.next().unwrap().parse().unwrap();
                let seq: u64 = w.next().unwrap().parse().unwrap();
                acked.insert(objno, seq);
                lines += 1;
                counted.store(lines, Ordering::Relaxed);
            }
        }
        (acked, lines)
    });
    // Kill once enough writes went through for the journal to have been checkpointed (the
    // first writes alone, whole objects, fill more than a quarter of it).
    let deadline = Instant::now() + Duration::from_secs(20);
    let journal = dir.join(JOURNAL_FILE);
    while count.load(Ordering::Relaxed) < 1500 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the writer exited early: {status}");
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (acked, lines) = reader.join().unwrap();
    assert!(lines > 200, "only {lines} writes were acknowledged before the kill");

    // The power loss: what the journal covers never reached the slot files.
    let f = OpenOptions::new().read(true).write(true).open(&journal).unwrap();
    let replay = crate::store::journal::Journal::open(f).unwrap();
    assert!(!replay.payloads.is_empty(), "the journal held no records at the kill");
    for p in &replay.payloads {
        for (key, offset, len, _) in decode_writes(p).unwrap() {
            let (class, no) = slot_of_key(key);
            if let Ok(f) = OpenOptions::new().write(true).open(slot_path_in(&dir, class, no)) {
                f.write_all_at(&vec![0xa5; len as usize], offset).unwrap();
            }
        }
    }
    // A torn last record: a whole header, half its payload.
    let ((end, boot), cap) = (replay.end(), replay.capacity());
    let payload = vec![0x5a; 4096];
    let mut torn = crate::store::journal::record_header(crate::store::journal::KIND_DATA, boot, end, &payload).to_vec();
    torn.extend_from_slice(&payload[..2048]);
    let jf = OpenOptions::new().write(true).open(&journal).unwrap();
    if cap - end % cap >= torn.len() as u64 {
        jf.write_all_at(&torn, crate::store::journal::HEADER_PAGE_BYTES + end % cap).unwrap();
    }
    drop((replay, jf));

    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    let boot = s.boot().unwrap();
    let versions: HashMap<ObjKey, Version> = boot.objects.iter().copied().collect();
    for (&objno, &seq) in &acked {
        let got = versions.get(&key(objno, 1)).copied().unwrap_or_else(|| panic!("object {objno} is gone"));
        assert!(got == v(seq) || got == v(seq + 1), "object {objno}: acknowledged seq {seq}, found {got:?}");
        assert_eq!(read_all(&s, key(objno, 1)), crash_model(objno, got.seq), "object {objno} at seq {}", got.seq);
    }
    // The store goes on: a write after the replay survives another reopen.
    write(&s, key(0, 1), 1_000_000, 0, vec![9; 4096]);
    drop(s);
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert_eq!(read(&s, key(0, 1), 0, 4096), vec![9; 4096]);
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

/// What a power-cut test finds after the crash: each object's version and bytes.
type Found = HashMap<ObjKey, (Version, Vec<u8>)>;
type Check = Box<dyn Fn(&Found) -> Result<(), String>>;

/// One command cut short: the acknowledged commands before it, the command, and what must
/// hold after the crash.
struct CutScenario {
    name: &'static str,
    setup: Vec<DiskCmd>,
    cmd: DiskCmd,
    checks: Vec<Check>,
}

fn patched(base: &[u8], at: usize, data: &[u8]) -> Vec<u8> {
    let mut b = base.to_vec();
    b.resize(b.len().max(at + data.len()), 0);
    b[at..at + data.len()].copy_from_slice(data);
    b
}

fn wr(k: ObjKey, seq: u64, offset: u32, data: Vec<u8>, cow_from: Option<ObjKey>) -> DiskCmd {
    DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Write { offset, data }, cow_from }
}

/// `k` holds exactly `bytes` at `ver`.
fn intact(k: ObjKey, ver: Version, bytes: Vec<u8>) -> Check {
    Box::new(move |found: &Found| match found.get(&k) {
        Some((v, b)) if *v == ver && *b == bytes => Ok(()),
        other => Err(format!("{k:?} should be intact at {ver:?}, is {:?}", other.map(|(v, b)| (v, b.len())))),
    })
}

/// `k` is as before the command (`old`, `None`: absent), as after it, or suspect.
fn old_new_or_suspect(k: ObjKey, old: Option<(Version, Vec<u8>)>, new: (Version, Vec<u8>)) -> Check {
    Box::new(move |found: &Found| match (found.get(&k), &old) {
        (Some((v, _)), _) if *v == objfmt::SUSPECT => Ok(()),
        (Some(x), _) if *x == new => Ok(()),
        (Some(x), Some(o)) if x == o => Ok(()),
        (None, None) => Ok(()),
        (x, _) => Err(format!("{k:?} is neither old, new nor suspect: {:?}", x.map(|(v, b)| (v, b.len())))),
    })
}

/// `k` is gone, or intact at `ver`.
fn gone_or_intact(k: ObjKey, ver: Version, bytes: Vec<u8>) -> Check {
    let intact = intact(k, ver, bytes);
    Box::new(move |found: &Found| if found.contains_key(&k) { intact(found) } else { Ok(()) })
}

/// A rename of `from` to `to` (which did not exist) happened whole or not at all.
fn renamed_or_not(from: ObjKey, to: ObjKey, ver: Version, bytes: Vec<u8>) -> Check {
    let (was, is) = (intact(from, ver, bytes.clone()), intact(to, ver, bytes));
    Box::new(move |found: &Found| match (found.contains_key(&from), found.contains_key(&to)) {
        (true, false) => was(found),
        (false, true) => is(found),
        both => Err(format!("the rename left (from, to) = {both:?}")),
    })
}

fn power_cut_scenarios() -> Vec<CutScenario> {
    let (p, c, q, small) = (key(1, 1), key(1, 2), key(1, 3), key(2, 1));
    let p0: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
    let c1 = patched(&p0, 0, &[0xcc; 2048]);
    let make_p = wr(p, 1, 0, p0.clone(), None);
    let make_c = wr(c, 2, 0, vec![0xcc; 2048], Some(p));
    vec![
        CutScenario {
            name: "overwrite in place",
            setup: vec![make_p.clone()],
            cmd: wr(p, 2, 4096, vec![0xbb; 4096], None),
            checks: vec![old_new_or_suspect(p, Some((v(1), p0.clone())), (v(2), patched(&p0, 4096, &[0xbb; 4096])))],
        },
        CutScenario {
            name: "move to a bigger class",
            setup: vec![wr(small, 1, 0, vec![5; 2048], None), make_p.clone()],
            cmd: wr(small, 2, 8192, vec![6; 4096], None),
            checks: vec![
                old_new_or_suspect(small, Some((v(1), vec![5; 2048])), (v(2), patched(&[5; 2048], 8192, &[6; 4096]))),
                intact(p, v(1), p0.clone()),
            ],
        },
        CutScenario {
            name: "delete",
            setup: vec![make_p.clone(), wr(small, 1, 0, vec![5; 2048], None)],
            cmd: DiskCmd::Delete { key: p },
            checks: vec![gone_or_intact(p, v(1), p0.clone()), intact(small, v(1), vec![5; 2048])],
        },
        CutScenario {
            name: "rename",
            setup: vec![make_p.clone()],
            cmd: DiskCmd::Rename { from: p, to: q },
            checks: vec![renamed_or_not(p, q, v(1), p0.clone())],
        },
        CutScenario {
            name: "a child's first write (a deferred copy)",
            setup: vec![make_p.clone()],
            cmd: make_c.clone(),
            checks: vec![intact(p, v(1), p0.clone()), old_new_or_suspect(c, None, (v(2), c1.clone()))],
        },
        CutScenario {
            name: "a parent write completes its deferred child first",
            setup: vec![make_p.clone(), make_c.clone()],
            cmd: wr(p, 3, 8192, vec![0xdd; 4096], None),
            checks: vec![
                intact(c, v(2), c1.clone()),
                old_new_or_suspect(p, Some((v(1), p0.clone())), (v(3), patched(&p0, 8192, &[0xdd; 4096]))),
            ],
        },
        CutScenario {
            name: "a parent delete completes its deferred child first",
            setup: vec![make_p, make_c],
            cmd: DiskCmd::Delete { key: p },
            checks: vec![intact(c, v(2), c1), gone_or_intact(p, v(1), p0)],
        },
    ]
}

/// The store's crash rules on the simulator's disk, at every point of a command: the power
/// is cut after each possible number of the command's disk operations, the disk crashes
/// (losing or tearing what was not synced, several ways each), and the store reopens. An
/// object a command did not touch is intact; the one it touched is old, new or suspect
/// (never gone with a torn header); a move keeps one copy; a delete or rename leaves the
/// old state or the new; a deferred copy's bytes survive every change to its parent.
#[test]
fn a_power_cut_anywhere_in_a_command_keeps_the_stores_crash_rules() {
    power_cut_anywhere(None, 4);
}

/// The same with the write-ahead journal on: a command's record is durable before its writes
/// reach the slot file, and open replays it.
#[test]
fn a_power_cut_anywhere_in_a_journaled_command_keeps_the_stores_crash_rules() {
    // One crash per cut point: every store here formats a 16 MiB journal on the in-memory
    // disk, which costs a debug build ~30 ms.
    power_cut_anywhere(Some(crate::store::journal::MIN_CAPACITY_BYTES), 1);
}

/// Runs every scenario with the power cut after each number of its command's disk operations,
/// and `crashes_per_cut` crashes (each losing and tearing differently) per cut point.
fn power_cut_anywhere(journal_capacity_bytes: Option<u64>, crashes_per_cut: u64) {
    // No background threads: every disk operation is the command's own.
    let pool = PoolOptions { background_refill: false, journal_capacity_bytes, ..PoolOptions::default() };
    let open = |fs: &SimFs| FileStore::open_on(fs.clone(), Path::new("shard"), true, pool.clone());
    let mut crashes = 0;
    for sc in power_cut_scenarios() {
        for cut_after in 0.. {
            let mut cut = false;
            for seed in 0..crashes_per_cut {
                let fs = SimFs::new();
                let store = open(&fs).unwrap();
                for cmd in &sc.setup {
                    store.run(cmd.clone()).unwrap();
                }
                fs.cut_power_after(cut_after);
                let _ = store.run(sc.cmd.clone());
                cut = fs.power_is_cut();
                drop(store);
                fs.crash(&mut sim::SimRng::new(seed));
                crashes += 1;
                let at = format!("{}, power cut after {cut_after} operations, crash seed {seed}", sc.name);
                let store = open(&fs).unwrap_or_else(|e| panic!("{at}: open: {e}"));
                let boot = store.boot().unwrap_or_else(|e| panic!("{at}: boot: {e}"));
                let read = |k: &ObjKey| match store.run(DiskCmd::ReadAll { key: *k }) {
                    Ok(DiskOut::Data(b)) => b,
                    other => panic!("{at}: {k:?} booted but reads {other:?}"),
                };
                let found: Found = boot.objects.iter().map(|(k, ver)| (*k, (*ver, read(k)))).collect();
                for check in &sc.checks {
                    check(&found).unwrap_or_else(|e| panic!("{at}: {e}"));
                }
                // The store goes on working after its recovery.
                store.run(wr(key(9, 9), 1, 0, vec![1; 100], None)).unwrap_or_else(|e| panic!("{at}: a write after recovery: {e:?}"));
            }
            if !cut {
                break; // the command ran whole: every point of it was cut
            }
        }
    }
    assert!(crashes > 50 * crashes_per_cut, "only {crashes} crashes");
}

#[test]
fn write_read_cow_rename_delete_and_boot() {
    let dir = tempdir();
    let s = FileStore::open(&dir, true).unwrap();
    let v1 = Version { epoch: 1, seq: 1 };
    s.run(DiskCmd::Apply { key: key(0, 1), version: v1, op: RepOp::Write { offset: 10, data: vec![5; 4] }, cow_from: None }).unwrap();
    let DiskOut::Data(d) = s.run(DiskCmd::Read { key: key(0, 1), offset: 8, len: 8 }).unwrap() else { panic!() };
    assert_eq!(d, vec![0, 0, 5, 5, 5, 5, 0, 0]);
    // Copy-on-write into the child, then write: the parent is untouched.
    let v2 = Version { epoch: 1, seq: 1 };
    s.run(DiskCmd::Apply { key: key(0, 2), version: v2, op: RepOp::Write { offset: 11, data: vec![9] }, cow_from: Some(key(0, 1)) }).unwrap();
    let DiskOut::Data(c) = s.run(DiskCmd::ReadAll { key: key(0, 2) }).unwrap() else { panic!() };
    assert_eq!(&c[10..14], &[5, 9, 5, 5]);
    let DiskOut::Data(p) = s.run(DiskCmd::ReadAll { key: key(0, 1) }).unwrap() else { panic!() };
    assert_eq!(&p[10..14], &[5, 5, 5, 5]);
    s.run(DiskCmd::Apply { key: key(0, 2), version: Version { epoch: 1, seq: 2 }, op: RepOp::Zero { offset: 10, len: 2 }, cow_from: None }).unwrap();
    let DiskOut::Data(c) = s.run(DiskCmd::Read { key: key(0, 2), offset: 10, len: 4 }).unwrap() else { panic!() };
    assert_eq!(c, vec![0, 0, 5, 5]);
    s.run(DiskCmd::Delete { key: key(0, 1) }).unwrap();
    s.run(DiskCmd::Rename { from: key(0, 2), to: key(0, 3) }).unwrap();
    s.run(DiskCmd::SaveState { seq: 2, bytes: vec![1, 2] }).unwrap();
    s.run(DiskCmd::SaveState { seq: 1, bytes: vec![9] }).unwrap();
    drop(s);
    let boot = FileStore::open(&dir, false).unwrap().boot().unwrap();
    assert_eq!(boot.objects, vec![(key(0, 3), Version { epoch: 1, seq: 2 })]);
    assert_eq!(boot.state, Some(vec![1, 2]));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_directory_is_a_clear_error() {
    let err = FileStore::open(Path::new("/nonexistent/understudy-shard"), false).err().unwrap();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn boot_after_reopen_finds_every_object_with_its_version() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    let mut want = vec![];
    // Objects of every class, some rewritten, some deleted, a Put, a tracking object.
    for i in 0..20u64 {
        let len = [100usize, 5000, 70_000, 2_000_000][i as usize % 4];
        write(&s, key(i, 1), 10 + i, 0, vec![i as u8 + 1; len]);
        if i % 3 == 0 {
            write(&s, key(i, 1), 100 + i, 7, vec![0xee; 10]);
        }
        if i % 5 == 4 {
            s.run(DiskCmd::Delete { key: key(i, 1) }).unwrap();
            continue;
        }
        want.push((key(i, 1), v(if i % 3 == 0 { 100 + i } else { 10 + i })));
    }
    let track = ObjKey { table: 7, objno: TRACK_OBJNO, owner: 0 };
    s.run(DiskCmd::Apply { key: track, version: v(5), op: RepOp::Put { data: vec![1, 2, 3] }, cow_from: None }).unwrap();
    want.push((track, v(5)));
    want.sort();
    drop(s);
    let boot = reopen_boot(&dir);
    assert_eq!(boot.objects, want);
    assert_eq!(boot.track_objects, vec![(track, vec![1, 2, 3])]);
    // And the contents survived.
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert_eq!(read(&s, key(1, 1), 0, 8), vec![2; 8]);
    assert_eq!(read(&s, key(3, 1), 5, 4), vec![4, 4, 0xee, 0xee]);
    assert_eq!(read_all(&s, key(2, 1)).len(), 70_000);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cow_into_a_fresh_slot_leaves_the_parent_untouched() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    let parent: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
    s.run(DiskCmd::Apply { key: key(3, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
    let (pclass, ppath) = s.slot_of(&key(3, 1)).unwrap();
    let parent_file = fs::read(&ppath).unwrap();
    s.run(DiskCmd::Apply { key: key(3, 2), version: v(2), op: RepOp::Write { offset: 4096, data: vec![0xab; 4096] }, cow_from: Some(key(3, 1)) }).unwrap();
    let (cclass, cpath) = s.slot_of(&key(3, 2)).unwrap();
    assert_ne!(cpath, ppath);
    assert_eq!(cclass, pclass);
    assert_eq!(fs::read(&ppath).unwrap(), parent_file, "the parent's slot file changed");
    let mut want = parent.clone();
    want[4096..8192].fill(0xab);
    assert_eq!(read_all(&s, key(3, 2)), want);
    assert_eq!(read_all(&s, key(3, 1)), parent);
    // A later parent write does not show in the child.
    write(&s, key(3, 1), 3, 0, vec![1; 10]);
    assert_eq!(read(&s, key(3, 2), 0, 2), parent[..2].to_vec());
    // A COW from a parent shorter than the write extends the copy.
    write(&s, key(4, 1), 1, 0, vec![7; 10]);
    s.run(DiskCmd::Apply { key: key(4, 2), version: v(2), op: RepOp::Write { offset: 100_000, data: vec![8; 10] }, cow_from: Some(key(4, 1)) }).unwrap();
    let c = read_all(&s, key(4, 2));
    assert_eq!((c.len(), &c[..10], c[50_000], &c[100_000..]), (100_010, &[7u8; 10][..], 0, &[8u8; 10][..]));
    // A COW from a missing parent is an error and creates nothing.
    assert!(s.run(DiskCmd::Apply { key: key(5, 2), version: v(2), op: RepOp::Write { offset: 0, data: vec![1] }, cow_from: Some(key(5, 1)) }).is_err());
    assert!(s.slot_of(&key(5, 2)).is_none());
    drop(s);
    let boot = reopen_boot(&dir);
    assert_eq!(boot.objects, vec![(key(3, 1), v(3)), (key(3, 2), v(2)), (key(4, 1), v(1)), (key(4, 2), v(2))]);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn objects_grow_across_classes_and_free_their_old_slots() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    write(&s, key(1, 1), 1, 0, vec![1; 100]);
    assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 0);
    // Stale bytes of an earlier object in the reused slot must not show through a gap.
    write(&s, key(2, 1), 1, 0, vec![0xff; 4096]);
    s.run(DiskCmd::Delete { key: key(2, 1) }).unwrap();
    write(&s, key(2, 1), 2, 0, vec![2; 10]);
    write(&s, key(2, 1), 3, 20, vec![3; 10]);
    assert_eq!(read(&s, key(2, 1), 0, 40), [vec![2; 10], vec![0; 10], vec![3; 10], vec![0; 10]].concat());
    // 4 KiB → 1 MiB → 4 MiB.
    write(&s, key(1, 1), 2, 200_000, vec![2; 10]);
    assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 2);
    write(&s, key(1, 1), 3, 4 * 1024 * 1024 - 10, vec![3; 10]);
    assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 3);
    let body = read_all(&s, key(1, 1));
    assert_eq!(body.len(), 4 << 20);
    assert_eq!((&body[..100], body[100], &body[200_000..200_010], &body[(4 << 20) - 10..]), (&[1u8; 100][..], 0, &[2u8; 10][..], &[3u8; 10][..]));
    // A whole-object Put into a small object moves it in one step; a shorter Put does not
    // move it back, and bytes past the new length read as zeroes.
    s.run(DiskCmd::Apply { key: key(2, 1), version: v(4), op: RepOp::Put { data: vec![9; 65536] }, cow_from: None }).unwrap();
    assert_eq!(s.slot_of(&key(2, 1)).unwrap().0, 1);
    s.run(DiskCmd::Apply { key: key(2, 1), version: v(5), op: RepOp::Put { data: vec![6; 5] }, cow_from: None }).unwrap();
    assert_eq!(s.slot_of(&key(2, 1)).unwrap().0, 1);
    assert_eq!(read(&s, key(2, 1), 0, 8), vec![6, 6, 6, 6, 6, 0, 0, 0]);
    assert_eq!(read_all(&s, key(2, 1)), vec![6; 5]);
    // Too big for any slot: refused, nothing changed.
    assert!(s.run(DiskCmd::Apply { key: key(2, 1), version: v(6), op: RepOp::Write { offset: 4 << 20, data: vec![1] }, cow_from: None }).is_err());
    // The slots left behind are free: 4 KiB (key 1, then key 2's), 1 MiB.
    let st = s.pool_stats();
    assert_eq!((st.free_slots, st.live_objects), ([2, 0, 1, 0], 2));
    assert_eq!(s.slot_files(), 5);
    drop(s);
    assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(3)), (key(2, 1), v(5))]);
    fs::remove_dir_all(&dir).unwrap();
}

/// Without the journal, each write's own fdatasync is all there is: slot bytes or headers lost
/// or torn in a crash show as suspect objects. With it, the same damage is repaired from the
/// journal's records at open (every one of those writes was acknowledged).
#[test]
fn torn_writes_are_suspect_after_boot_without_a_journal_and_repaired_with_one() {
    for journal in [false, true] {
        torn_writes(journal);
    }
}

fn torn_writes(journal: bool) {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, if journal { quiet() } else { no_journal() }).unwrap();
    for i in 0..5 {
        s.run(DiskCmd::Apply { key: key(i, 1), version: v(1), op: RepOp::Put { data: vec![i as u8; 65536] }, cow_from: None }).unwrap();
    }
    let path = |k| s.slot_of(&key(k, 1)).unwrap().1;
    let before: Vec<Vec<u8>> = (0..5).map(|i| fs::read(path(i)).unwrap()).collect();
    for i in 0..5 {
        write(&s, key(i, 1), 2, 8192, vec![0x55; 4096]);
    }
    let page = SLOT_HEADER_PAGE_BYTES as usize;
    let patch = |k: u64, at: usize, bytes: &[u8]| {
        let f = OpenOptions::new().write(true).open(path(k)).unwrap();
        f.write_all_at(bytes, at as u64).unwrap();
    };
    // 0: a data byte flipped (lost or torn data under a kept header).
    patch(0, page + 9000, &[0x54]);
    // 1: the old header page restored (the new header lost, the new data kept).
    patch(1, 0, &before[1][..page]);
    // 2: the old data restored (the new data lost, the new header kept).
    patch(2, page + 8192, &before[2][page + 8192..page + 12288]);
    // 3: the newest header copy torn: the older copy still names the object, whose bytes
    //    no longer match it.
    let f = File::open(path(3)).unwrap();
    let (copy, _) = s.inner.read_header(&f, 1).unwrap().unwrap();
    patch(3, copy as usize * HEADER_COPY_BYTES + 100, &[0xde, 0xad]);
    // 4: untouched.
    drop(s);
    let boot = FileStore::open_with(&dir, false, if journal { quiet() } else { no_journal() }).unwrap().boot().unwrap();
    let s = if journal { v(2) } else { objfmt::SUSPECT };
    assert_eq!(boot.objects, vec![(key(0, 1), s), (key(1, 1), s), (key(2, 1), s), (key(3, 1), s), (key(4, 1), v(2))], "journal: {journal}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_crash_between_a_move_and_freeing_the_old_slot_keeps_the_newer_copy() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    write(&s, key(2, 1), 1, 0, vec![3; 10]);
    write(&s, key(2, 2), 1, 0, vec![4; 10]);
    write(&s, key(1, 1), 1, 0, vec![1; 100]);
    let (_, small) = s.slot_of(&key(1, 1)).unwrap();
    let small_before = fs::read(&small).unwrap();
    write(&s, key(1, 1), 2, 10_000, vec![2; 100]);
    // The old slot's free header never reached the disk. (Nothing writes after this, so
    // the freed slot is not taken again.)
    fs::write(&small, &small_before).unwrap();
    // Likewise a rename onto an existing key whose old slot was not freed.
    let (_, heir) = s.slot_of(&key(2, 2)).unwrap();
    let heir_before = fs::read(&heir).unwrap();
    s.run(DiskCmd::Rename { from: key(2, 1), to: key(2, 2) }).unwrap();
    fs::write(&heir, &heir_before).unwrap();
    drop(s);
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(2)), (key(2, 2), v(1))]);
    assert_eq!(read(&s, key(1, 1), 99, 2), vec![1, 0]);
    assert_eq!(read_all(&s, key(2, 2)), vec![3; 10]);
    assert_eq!(s.pool_stats().free_slots, [2, 0, 0, 0]);
    // The losers were freed durably.
    drop(s);
    assert_eq!(FileStore::open_with(&dir, false, quiet()).unwrap().pool_stats().free_slots, [2, 0, 0, 0]);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn free_slots_are_reused() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    write(&s, key(1, 1), 1, 0, vec![1; 60_000]);
    let (_, first) = s.slot_of(&key(1, 1)).unwrap();
    s.run(DiskCmd::Delete { key: key(1, 1) }).unwrap();
    assert_eq!(read(&s, key(1, 1), 0, 4), vec![0; 4]);
    assert!(s.run(DiskCmd::ReadAll { key: key(1, 1) }).is_err());
    s.run(DiskCmd::Delete { key: key(1, 1) }).unwrap(); // deleting nothing is fine
    write(&s, key(9, 3), 2, 0, vec![2; 1000]); // 4 KiB class: a new slot
    write(&s, key(9, 4), 2, 0, vec![2; 50_000]);
    assert_eq!(s.slot_of(&key(9, 4)).unwrap().1, first, "the freed 64 KiB slot was not reused");
    assert_eq!(read(&s, key(9, 4), 49_998, 4), vec![2, 2, 0, 0], "stale bytes past the length");
    assert_eq!(s.slot_files(), 2);
    assert_eq!(s.pool_stats().slow_allocations, 2);
    drop(s);
    assert_eq!(reopen_boot(&dir).objects, vec![(key(9, 3), v(2)), (key(9, 4), v(2))]);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eight_threads_write_different_keys() {
    let dir = tempdir();
    let s = FileStore::open(&dir, true).unwrap();
    let parent: Vec<u8> = (0..65536u32).map(|i| (i / 256) as u8).collect();
    for t in 0..8u64 {
        s.run(DiskCmd::Apply { key: key(t, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
    }
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let s = &s;
            sc.spawn(move || {
                for i in 0..40u64 {
                    // Thread t owns objects ≡ t (mod 8): plain writes, COWs, Puts, deletes.
                    let objno = t + 8 * (i % 5);
                    let data = vec![(t * 40 + i) as u8; 4096];
                    let cow = (objno == t && i >= 5).then_some(key(t, 1));
                    let k = if cow.is_some() { key(objno, 2 + i) } else { key(objno, 1) };
                    s.run(DiskCmd::Apply { key: k, version: v(10 + i), op: RepOp::Write { offset: 4096 * (i % 16) as u32, data }, cow_from: cow }).unwrap();
                    if i % 7 == 6 {
                        s.run(DiskCmd::Delete { key: k }).unwrap();
                    }
                }
            });
        }
    });
    let stats = s.pool_stats();
    let mut want = vec![];
    for t in 0..8u64 {
        for i in 0..40u64 {
            let objno = t + 8 * (i % 5);
            let cow = objno == t && i >= 5;
            let k = if cow { key(objno, 2 + i) } else { key(objno, 1) };
            let got = read(&s, k, 4096 * (i % 16) as u32, 4096);
            if i % 7 == 6 {
                continue;
            }
            if cow {
                assert_eq!(got, vec![(t * 40 + i) as u8; 4096], "COW child {k:?}");
                want.push((k, v(10 + i)));
            }
        }
        for r in 0..5u64 {
            let last = (0..40u64).filter(|i| i % 5 == r && !(r == 0 && *i >= 5)).max().unwrap();
            let k = key(t + 8 * r, 1);
            if last % 7 != 6 {
                want.push((k, v(10 + last)));
            }
        }
    }
    want.sort();
    drop(s);
    assert_eq!(reopen_boot(&dir).objects, want);
    assert!(stats.live_objects == want.len(), "{stats:?}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_refill_keeps_free_slots_ready_grows_under_bursts_and_trims_extras() {
    let dir = tempdir();
    let mut pool = PoolOptions::default();
    pool.free_slots_target = [3, 5, 0, 0];
    pool.free_slots_max = [3, 8, 0, 0];
    let s = FileStore::open_with(&dir, true, pool).unwrap();
    let wait_until = |what: &str, done: &dyn Fn(&PoolStats) -> bool| {
        let start = Instant::now();
        while !done(&s.pool_stats()) {
            assert!(start.elapsed() < Duration::from_secs(30), "{what}: {:?}", s.pool_stats());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // The first 64 KiB object finds the class empty: a slow allocation, and the target
    // doubles (capped at the maximum).
    write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
    let st = s.pool_stats();
    assert_eq!((st.slow_allocations, st.free_slots_target), (1, [3, 8, 0, 0]));
    wait_until("the refill stocks the class in use", &|st| st.free_slots[1] >= 5);
    assert_eq!(s.pool_stats().free_slots[0], 0, "a class never used got slots");
    wait_until("the target decays to its base", &|st| st.free_slots_target[1] == 5);
    // A burst, then its objects deleted: the free slots beyond the maximum go.
    for i in 2..14 {
        write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
    }
    for i in 2..14 {
        s.run(DiskCmd::Delete { key: key(i, 1) }).unwrap();
    }
    wait_until("trimmed to the maximum", &|st| st.free_slots[1] == 8 && s.slot_files() == 9);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn super_prestocks_a_slot_for_every_parent_object_so_child_writes_allocate_nothing() {
    let dir = tempdir();
    let mut pool = PoolOptions::default();
    pool.free_slots_target = [0, 1, 0, 0];
    pool.free_slots_max = [0, 64, 64, 0];
    let s = FileStore::open_with(&dir, true, pool).unwrap();
    // The parent (owner 1): twelve 64 KiB-class objects and two 1 MiB-class ones; another
    // volume of the table (owner 5) must not count.
    for i in 0..12 {
        write(&s, key(i, 1), 1, 0, vec![1; 65536]);
    }
    for i in 12..14 {
        write(&s, key(i, 1), 1, 0, vec![1; 100_000]);
    }
    write(&s, key(20, 5), 1, 0, vec![5; 4096]);
    let wait_until = |what: &str, done: &dyn Fn(&PoolStats) -> bool| {
        let start = Instant::now();
        while !done(&s.pool_stats()) {
            assert!(start.elapsed() < Duration::from_secs(30), "{what}: {:?}", s.pool_stats());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
    let st = s.pool_stats();
    assert!(st.prestocks == 1 && st.reserved_slots[1] == 12 && st.reserved_slots[2] == 2, "{st:?}");
    wait_until("the refill makes the pre-stocked slots", &|st| st.reserved_free_slots[1] == 12 && st.reserved_free_slots[2] == 2);
    // Quiet seconds (the child has not started writing) keep the reservation.
    std::thread::sleep(Duration::from_millis(2500));
    let st = s.pool_stats();
    assert!(st.reserved_slots[1] == 12 && st.reserved_free_slots[1] == 12, "{st:?}");
    // The child's first writes (deferred copies, and a whole copy of a bigger object) all
    // take ready slots: no allocation on their path.
    let slow = s.pool_stats().slow_allocations;
    for i in 0..14 {
        s.run(DiskCmd::Apply { key: key(i, 2), version: v(1), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(i, 1)) })
            .unwrap();
        assert_eq!(read(&s, key(i, 2), 0, 8192)[4090..4100], [2, 2, 2, 2, 2, 2, 1, 1, 1, 1]);
    }
    let st = s.pool_stats();
    assert_eq!(st.slow_allocations, slow, "{st:?}");
    assert_eq!(st.counters.slots_from_reserve, 14, "{st:?}");
    assert_eq!(st.reserved_slots, [0; CLASSES], "{st:?}");
    drop(s); // stops the refill thread
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_a_childs_first_writes_take_its_reserved_slots() {
    let dir = tempdir();
    let pool = PoolOptions { free_slots_target: [0, 4, 0, 0], free_slots_max: [0, 64, 0, 0], ..quiet() };
    let s = FileStore::open_with(&dir, true, pool).unwrap();
    // The parent (owner 1): ten objects of the 64 KiB class.
    for i in 0..10 {
        write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
    }
    // Six free slots in the pool (a burst's objects deleted).
    for i in 0..6 {
        write(&s, key(i, 8), 1, 0, vec![1; 10_000]);
    }
    for i in 0..6 {
        s.run(DiskCmd::Delete { key: key(i, 8) }).unwrap();
    }
    assert_eq!(s.pool_stats().free_slots[1], 6);
    // super: ten slots owed to the child; the six free ones move into its reservation at
    // once (no refill runs in this test).
    s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
    let st = s.pool_stats();
    assert_eq!((st.reserved_slots[1], st.reserved_free_slots[1], st.free_slots[1]), (10, 6, 0), "{st:?}");
    // Another volume's burst of new objects (a general clone's copy-ups) does not touch
    // them: each of its writes makes its slot itself.
    let slow = st.slow_allocations;
    for i in 0..3 {
        write(&s, key(i, 9), 1, 0, vec![1; 10_000]);
    }
    let st = s.pool_stats();
    assert_eq!((st.slow_allocations - slow, st.reserved_free_slots[1], st.reserved_slots[1]), (3, 6, 10), "{st:?}");
    // A slot freed while the reservation lacks slots goes to the reservation.
    s.run(DiskCmd::Delete { key: key(0, 9) }).unwrap();
    let st = s.pool_stats();
    assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (7, 0), "{st:?}");
    // The child's first writes take reserved slots and count them off, one each.
    let slow = st.slow_allocations;
    for i in 0..3 {
        s.run(DiskCmd::Apply { key: key(i, 2), version: v(1), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(i, 1)) })
            .unwrap();
    }
    let st = s.pool_stats();
    assert_eq!((st.reserved_slots[1], st.reserved_free_slots[1]), (7, 4), "{st:?}");
    assert_eq!((st.counters.slots_from_reserve, st.slow_allocations), (3, slow), "{st:?}");
    // Overwrites of the child's objects take no slot at all.
    s.run(DiskCmd::Apply { key: key(0, 2), version: v(2), op: RepOp::Write { offset: 0, data: vec![3; 4096] }, cow_from: None }).unwrap();
    assert_eq!(s.pool_stats().reserved_slots[1], 7);
    // A second, smaller reservation does not add to the first.
    s.run(DiskCmd::Prestock { table: 7, parent: 9 }).unwrap();
    assert_eq!(s.pool_stats().reserved_slots[1], 7);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_refill_stocks_the_reservation_and_the_free_list_apart() {
    let dir = tempdir();
    let pool = PoolOptions { free_slots_target: [0, 3, 0, 0], free_slots_max: [0, 8, 0, 0], reserved_slots_max: [0, 5, 0, 0], ..quiet() };
    let s = FileStore::open_with(&dir, true, pool).unwrap();
    for i in 0..9 {
        write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
    }
    s.inner.index.lock().unwrap().target[1] = 3;
    // Nine parent objects, but at most five slots reserved.
    s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
    assert_eq!(s.pool_stats().reserved_slots[1], 5);
    assert!(!s.inner.refill(1));
    let st = s.pool_stats();
    assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (5, 3), "{st:?}");
    // Other writes drain the free list only.
    for i in 0..3 {
        write(&s, key(i, 9), 1, 0, vec![1; 10_000]);
    }
    let st = s.pool_stats();
    assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (5, 0), "{st:?}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_refill_holds_back_while_writes_are_served_but_never_below_its_floor() {
    let dir = tempdir();
    let pool = PoolOptions { free_slots_target: [0, 8, 0, 0], free_slots_max: [0, 8, 0, 0], ..quiet() };
    let s = FileStore::open_with(&dir, true, pool).unwrap();
    let free = |s: &FileStore| s.pool_stats().free_slots[1];
    // One 64 KiB object: the class is in use (and that write counts as serving writes).
    write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
    assert_eq!(free(&s), 0);
    // Below the floor (8 / 4 = 2 slots): the refill tops up whatever the shard is doing.
    // (The write just made counts as recent however long its fdatasync took on a loaded
    // machine.)
    s.inner.last_write_us.store((s.inner.opened.elapsed().as_micros() as u64).max(1), Ordering::Relaxed);
    assert!(s.inner.serving_writes());
    assert!(!s.inner.refill(1));
    assert_eq!(free(&s), 8);
    // Above the floor while writes are served: it holds back and says so.
    for i in 0..5 {
        s.inner.take_slot(1, false).unwrap();
        assert_eq!(free(&s), 7 - i);
    }
    s.inner.last_write_us.store((s.inner.opened.elapsed().as_micros() as u64).max(1), Ordering::Relaxed);
    assert!(s.inner.refill(1));
    assert_eq!(free(&s), 3);
    // Once the writes are older than the yield window, it tops up.
    std::thread::sleep(Duration::from_millis(REFILL_YIELD_MS + 10));
    assert!(!s.inner.serving_writes());
    assert!(!s.inner.refill(1));
    assert_eq!(free(&s), 8);
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn slot_files_whose_creation_was_interrupted_are_removed_at_open() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
    let class_dir = s.inner.class_dir(1);
    drop(s);
    // Short; full size but never written (holes); not a slot file at all.
    fs::write(class_dir.join("5"), [0u8; 100]).unwrap();
    File::create(class_dir.join("6")).unwrap().set_len(slot_file_bytes(1)).unwrap();
    fs::write(class_dir.join("notes.txt"), b"hello").unwrap();
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert!(!class_dir.join("5").exists() && !class_dir.join("6").exists());
    assert!(class_dir.join("notes.txt").exists());
    assert_eq!(s.pool_stats().free_slots, [0; CLASSES]);
    assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(1))]);
    // New slots do not reuse the numbers seen.
    write(&s, key(2, 1), 1, 0, vec![1; 10_000]);
    assert_eq!(s.slot_of(&key(2, 1)).unwrap().1, class_dir.join("7"));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn objects_of_the_one_file_per_object_layout_are_imported() {
    let dir = tempdir();
    let table_dir = dir.join("objects").join(format!("{:016x}", 7));
    fs::create_dir_all(&table_dir).unwrap();
    let mut good = objfmt::Header { version: v(4), crcs: vec![crc32c::crc32c(&[5; 10])] }.encode().to_vec();
    good.extend([5; 10]);
    fs::write(table_dir.join(format!("{:016x}.{:016x}", 1, 1)), &good).unwrap();
    let mut torn = good.clone();
    torn[HEADER_BYTES as usize] = 6;
    fs::write(table_dir.join(format!("{:016x}.{:016x}", 2, 1)), &torn).unwrap();
    fs::write(table_dir.join(format!("{:016x}.{:016x}.cow", 3, 1)), &good).unwrap();
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(4)), (key(2, 1), objfmt::SUSPECT)]);
    assert_eq!(read_all(&s, key(1, 1)), vec![5; 10]);
    assert!(!dir.join("objects").exists());
    fs::remove_dir_all(&dir).unwrap();
}

/// A 2 MiB tmpfs fills up: writes that need a new slot fail with NoSpace and change nothing;
/// overwrites still work (their blocks exist); a freed slot is used again.
#[test]
fn a_full_disk_gives_no_space_and_changes_nothing() {
    let dir = tempdir();
    let mnt = dir.join("tiny");
    fs::create_dir_all(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !mounted {
        eprintln!("SKIPPED a_full_disk_gives_no_space_and_changes_nothing: cannot mount a tmpfs at {} (needs root)", mnt.display());
        fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let result = std::panic::catch_unwind(|| {
        let root = mnt.join("shard");
        // The default pool: its refill must stay out of a disk this small (reserve). No
        // journal: it alone would take more than the disk.
        let s = FileStore::open_with(&root, true, PoolOptions { journal_capacity_bytes: None, ..PoolOptions::default() }).unwrap();
        let mut stored = vec![];
        let full = loop {
            let k = key(stored.len() as u64, 1);
            assert!(stored.len() < 64, "a 2 MiB disk took 64 objects of 64 KiB");
            match s.run(DiskCmd::Apply { key: k, version: v(1), op: RepOp::Put { data: vec![1; 65536] }, cow_from: None }) {
                Ok(_) => stored.push(k),
                Err(DiskErr::NoSpace) => break k,
                Err(e) => panic!("{e:?}"),
            }
        };
        assert!(stored.len() >= 10, "only {} objects fit", stored.len());
        assert!(s.run(DiskCmd::ReadAll { key: full }).is_err());
        let child = key(0, 2);
        assert_eq!(
            s.run(DiskCmd::Apply { key: child, version: v(2), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(0, 1)) }),
            Err(DiskErr::NoSpace)
        );
        assert_eq!(read(&s, child, 0, 4), vec![0; 4]);
        // Overwrites need no space.
        for k in &stored {
            write(&s, *k, 2, 4096, vec![3; 4096]);
        }
        // Room again after a delete: the freed slot is taken.
        s.run(DiskCmd::Delete { key: stored[0] }).unwrap();
        s.run(DiskCmd::Apply { key: full, version: v(3), op: RepOp::Put { data: vec![4; 65536] }, cow_from: None }).unwrap();
        let files = s.slot_files();
        drop(s);
        let boot = FileStore::open_with(&root, false, no_journal()).unwrap().boot().unwrap();
        let mut want: Vec<_> = stored[1..].iter().map(|k| (*k, v(2))).collect();
        want.push((full, v(3)));
        want.sort();
        assert_eq!(boot.objects, want);
        // No half-created slot files were left behind.
        assert_eq!(files, stored.len());
    });
    let _ = std::process::Command::new("umount").arg(&mnt).status();
    fs::remove_dir_all(&dir).unwrap();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("understudy-store-{}-{}", std::process::id(), rand::random::<u32>()));
    fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_first_child_write_copies_only_the_sectors_it_touches() {
    let dir = tempdir();
    let s = FileStore::open_with(&dir, true, quiet()).unwrap();
    let parent: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
    s.run(DiskCmd::Apply { key: key(1, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
    // 100 bytes across the boundary of sectors 2 and 3.
    s.run(DiskCmd::Apply { key: key(1, 2), version: v(2), op: RepOp::Write { offset: 3 * 4096 - 50, data: vec![0; 100] }, cow_from: Some(key(1, 1)) }).unwrap();
    let mut want = parent.clone();
    want[3 * 4096 - 50..3 * 4096 + 50].fill(0);
    assert_eq!(read_all(&s, key(1, 2)), want);
    assert_eq!(read(&s, key(1, 2), 3 * 4096 - 52, 4), vec![want[3 * 4096 - 52], want[3 * 4096 - 51], 0, 0]);
    // The child's slot holds sectors 2 and 3 only (a fresh slot is zeroes elsewhere).
    let (_, cpath) = s.slot_of(&key(1, 2)).unwrap();
    let page = SLOT_HEADER_PAGE_BYTES as usize;
    let file = fs::read(&cpath).unwrap();
    assert_eq!(&file[page + 2 * 4096..page + 4 * 4096], &want[2 * 4096..4 * 4096]);
    assert!(file[page..page + 2 * 4096].iter().all(|&b| b == 0), "sectors 0-1 were copied");
    assert!(file[page + 4 * 4096..].iter().all(|&b| b == 0), "sectors 4-15 were copied");
    // It survives a reopen as a deferred copy with valid checksums.
    drop(s);
    assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(1)), (key(1, 2), v(2))]);
    let s = FileStore::open_with(&dir, false, quiet()).unwrap();
    assert_eq!(read_all(&s, key(1, 2)), want);
    // A parent write completes the child first: the child keeps the parent's old bytes.
    write(&s, key(1, 1), 3, 0, vec![0xee; 65536]);
    assert!(s.inner.entry(&key(1, 2)).unwrap().base.is_none());
    assert_eq!(read_all(&s, key(1, 2)), want);
    assert_eq!(fs::read(&cpath).unwrap()[page..page + 65536], want[..]);
    drop(s);
    assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(3)), (key(1, 2), v(2))]);
    fs::remove_dir_all(&dir).unwrap();
}

/// Random writes, zeroes, Puts, copy-on-write children, deletes, renames and reopens against
/// an in-memory model: deferred copies must read, survive and end exactly like whole copies.
#[test]
fn deferred_copies_match_a_model_through_every_operation() {
    let dir = tempdir();
    let mut s = FileStore::open_with(&dir, true, quiet()).unwrap();
    let mut model: HashMap<ObjKey, (Version, Vec<u8>)> = HashMap::new();
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut seq = 0;
    let mut deferred_steps = 0;
    for step in 0..1500 {
        seq += 1;
        let objno = next(4);
        let (parent, child) = (key(objno, 1), key(objno, 2 + next(2)));
        let k = if next(3) == 0 { parent } else { child };
        match next(10) {
            0..=5 => {
                let len = [1u64, 100, 4096, 5000, 20_000][next(5) as usize];
                let beyond = if next(8) == 0 { 10_000 } else { 0 };
                let offset = next(65536 - len + 1 + beyond) as u32;
                let data: Vec<u8> = (0..len).map(|_| next(255) as u8 + 1).collect();
                let cow = (!model.contains_key(&k) && k != parent && model.contains_key(&parent)).then_some(parent);
                s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Write { offset, data: data.clone() }, cow_from: cow }).unwrap();
                let mut body = cow.map_or(vec![], |p| model[&p].1.clone());
                if let Some((_, b)) = model.get(&k) {
                    body = b.clone();
                }
                let end = offset as usize + data.len();
                if body.len() < end {
                    body.resize(end, 0);
                }
                body[offset as usize..end].copy_from_slice(&data);
                model.insert(k, (v(seq), body));
            }
            6 if model.contains_key(&k) => {
                let (offset, len) = (next(65536) as u32, next(20_000) as u32);
                s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Zero { offset, len }, cow_from: None }).unwrap();
                let m = model.get_mut(&k).unwrap();
                let end = (offset as usize + len as usize).min(m.1.len());
                if end > offset as usize {
                    m.1[offset as usize..end].fill(0);
                }
                m.0 = v(seq);
            }
            7 => {
                let data = vec![next(255) as u8; [10usize, 65536, 100_000][next(3) as usize]];
                s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Put { data: data.clone() }, cow_from: None }).unwrap();
                model.insert(k, (v(seq), data));
            }
            8 => {
                s.run(DiskCmd::Delete { key: k }).unwrap();
                model.remove(&k);
            }
            9 if model.contains_key(&child) => {
                // Garbage collection hands objects over by renaming them.
                let to = key(objno, if child.owner == 2 { 3 } else { 2 });
                s.run(DiskCmd::Rename { from: child, to }).unwrap();
                let m = model.remove(&child).unwrap();
                model.insert(to, m);
            }
            _ => {}
        }
        if step % 100 == 99 {
            drop(s);
            let mut want: Vec<(ObjKey, Version)> = model.iter().map(|(k, (v, _))| (*k, *v)).collect();
            want.sort();
            assert_eq!(reopen_boot(&dir).objects, want, "step {step}");
            s = FileStore::open_with(&dir, false, quiet()).unwrap();
        }
        for (k, (_, body)) in &model {
            assert_eq!(&read_all(&s, *k), body, "step {step} {k:?}");
            deferred_steps += s.inner.entry(k).unwrap().base.is_some() as usize;
        }
    }
    assert!(deferred_steps > 500, "the run hardly exercised deferred copies ({deferred_steps})");
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}
