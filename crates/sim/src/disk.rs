//! [`SimDisk`]: a simulated local disk of named files with power-loss semantics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::rng::SimRng;

/// Unit of tearing: a torn write applies some whole sectors and not others.
pub const SECTOR_BYTES: u64 = 512;
/// Capacity of a new [`SimDisk`]; change with [`SimDisk::set_capacity_bytes`].
pub const DEFAULT_CAPACITY_BYTES: u64 = 1 << 30;

/// Why a disk operation failed. A failed operation changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskError {
    /// No file of that name exists.
    NotFound(String),
    /// The operation would grow the total size of all files beyond the capacity.
    NoSpace { capacity_bytes: u64 },
    /// An injected I/O error (see [`SimDisk::fail_next_ops`]).
    Io,
}

impl fmt::Display for DiskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskError::NotFound(name) => write!(f, "file {name:?} not found"),
            DiskError::NoSpace { capacity_bytes } => {
                write!(
                    f,
                    "no space left: files would exceed the disk capacity of {capacity_bytes} bytes"
                )
            }
            DiskError::Io => write!(f, "I/O error (injected by the simulator)"),
        }
    }
}

impl std::error::Error for DiskError {}

type FileId = u64;

enum FileOp {
    Write { offset: u64, data: Vec<u8> },
    Truncate { len: u64 },
}

enum DirOp {
    Create { name: String, id: FileId },
    Delete { name: String },
    Rename { from: String, to: String },
}

#[derive(Default)]
struct Inode {
    durable: Vec<u8>,
    cached: Vec<u8>,
    pending: Vec<FileOp>,
}

/// A simulated disk holding one directory of named files.
///
/// The model is a page cache over a disk. Every operation takes effect immediately in the cache,
/// which is what reads see, and is also recorded as *pending* until made durable:
/// - file data (writes, truncates) by [`SimDisk::sync`] of that file (fdatasync);
/// - the directory (create, delete, rename) by [`SimDisk::sync_dir`] (fsync of the directory).
///
/// [`SimDisk::crash`] is a power loss. Pending operations are replayed in order onto the durable
/// state, each independently: a directory operation or a truncate is kept or lost (1/2 each); a
/// write is kept whole, lost, or torn (1/3 each), where torn applies some but not all of the
/// [`SECTOR_BYTES`]-aligned sectors it covers (a sector itself is never torn). A lost create
/// drops the file; a rename or delete whose source no longer exists is skipped. Afterwards
/// everything left is durable. Because each operation is decided independently, a crash can
/// produce states a journaling filesystem would not (a later rename kept, an earlier create
/// lost): deliberately adversarial, so only what was synced may be relied on.
pub struct SimDisk {
    names: BTreeMap<String, FileId>,
    durable_names: BTreeMap<String, FileId>,
    dir_pending: Vec<DirOp>,
    inodes: BTreeMap<FileId, Inode>,
    next_id: FileId,
    capacity_bytes: Option<u64>,
    fail_ops_remaining: u64,
}

impl Default for SimDisk {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDisk {
    /// An empty disk with [`DEFAULT_CAPACITY_BYTES`] and no injected faults.
    pub fn new() -> Self {
        Self {
            names: BTreeMap::new(),
            durable_names: BTreeMap::new(),
            dir_pending: Vec::new(),
            inodes: BTreeMap::new(),
            next_id: 0,
            capacity_bytes: Some(DEFAULT_CAPACITY_BYTES),
            fail_ops_remaining: 0,
        }
    }

    /// Creates an empty file; a no-op if it exists (like `open(O_CREAT)` without `O_EXCL`).
    pub fn create(&mut self, name: &str) -> Result<(), DiskError> {
        self.injected_fault()?;
        if !self.names.contains_key(name) {
            let id = self.next_id;
            self.next_id += 1;
            self.inodes.insert(id, Inode::default());
            self.names.insert(name.to_string(), id);
            self.dir_pending.push(DirOp::Create {
                name: name.to_string(),
                id,
            });
        }
        Ok(())
    }

    /// Writes `data` at `offset`, extending the file (zero-filling any hole) if needed.
    pub fn write(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<(), DiskError> {
        self.injected_fault()?;
        let id = self.id(name)?;
        if data.is_empty() {
            return Ok(()); // like pwrite: an empty write does not extend the file
        }
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or(self.no_space())?;
        self.check_growth(id, end)?;
        let inode = self.inodes.get_mut(&id).expect("named file has an inode");
        apply_write(&mut inode.cached, offset, data);
        inode.pending.push(FileOp::Write {
            offset,
            data: data.to_vec(),
        });
        Ok(())
    }

    /// Reads up to `len` bytes at `offset`, like `pread`: short at end of file, empty beyond it.
    /// Sees unsynced data.
    pub fn read(&mut self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, DiskError> {
        self.injected_fault()?;
        let cached = &self.inodes[&self.id(name)?].cached;
        let start = offset.min(cached.len() as u64) as usize;
        let end = offset.saturating_add(len).min(cached.len() as u64) as usize;
        Ok(cached[start..end].to_vec())
    }

    /// Sets the file's length, cutting or zero-extending it.
    pub fn truncate(&mut self, name: &str, len: u64) -> Result<(), DiskError> {
        self.injected_fault()?;
        let id = self.id(name)?;
        self.check_growth(id, len)?;
        let inode = self.inodes.get_mut(&id).expect("named file has an inode");
        inode.cached.resize(to_usize(len), 0);
        inode.pending.push(FileOp::Truncate { len });
        Ok(())
    }

    /// Removes the name. The data stays reachable by a crash that loses the delete.
    pub fn delete(&mut self, name: &str) -> Result<(), DiskError> {
        self.injected_fault()?;
        self.id(name)?;
        self.names.remove(name);
        self.dir_pending.push(DirOp::Delete {
            name: name.to_string(),
        });
        Ok(())
    }

    /// Renames `from` to `to`, atomically replacing any file named `to`.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), DiskError> {
        self.injected_fault()?;
        let id = self.id(from)?;
        if from != to {
            self.names.remove(from);
            self.names.insert(to.to_string(), id);
            self.dir_pending.push(DirOp::Rename {
                from: from.to_string(),
                to: to.to_string(),
            });
        }
        Ok(())
    }

    /// Makes the file's data and length durable (fdatasync). Its name is durable only after
    /// [`sync_dir`](Self::sync_dir).
    pub fn sync(&mut self, name: &str) -> Result<(), DiskError> {
        self.injected_fault()?;
        let inode = self
            .inodes
            .get_mut(&self.id(name)?)
            .expect("named file has an inode");
        inode.durable = inode.cached.clone();
        inode.pending.clear();
        Ok(())
    }

    /// Makes every create, delete and rename so far durable.
    pub fn sync_dir(&mut self) -> Result<(), DiskError> {
        self.injected_fault()?;
        self.durable_names = self.names.clone();
        self.dir_pending.clear();
        self.drop_unnamed_inodes();
        Ok(())
    }

    /// Power loss: see [`SimDisk`]. Injected-fault settings survive the crash.
    pub fn crash(&mut self, rng: &mut SimRng) {
        let mut names = std::mem::take(&mut self.durable_names);
        for op in std::mem::take(&mut self.dir_pending) {
            if !rng.chance(0.5) {
                continue;
            }
            match op {
                DirOp::Create { name, id } => {
                    names.insert(name, id);
                }
                DirOp::Delete { name } => {
                    names.remove(&name);
                }
                DirOp::Rename { from, to } => {
                    if let Some(id) = names.remove(&from) {
                        names.insert(to, id);
                    }
                }
            }
        }
        self.names = names.clone();
        self.durable_names = names;
        self.drop_unnamed_inodes();
        for inode in self.inodes.values_mut() {
            for op in std::mem::take(&mut inode.pending) {
                match op {
                    FileOp::Truncate { len } => {
                        if rng.chance(0.5) {
                            inode.durable.resize(to_usize(len), 0);
                        }
                    }
                    FileOp::Write { offset, data } => match rng.range_u64(0, 2) {
                        0 => apply_write(&mut inode.durable, offset, &data),
                        1 => {} // lost
                        _ => tear_write(rng, &mut inode.durable, offset, &data),
                    },
                }
            }
            inode.cached = inode.durable.clone();
        }
    }

    /// Length of the file in bytes, including unsynced changes.
    pub fn len(&self, name: &str) -> Result<u64, DiskError> {
        Ok(self.inodes[&self.id(name)?].cached.len() as u64)
    }

    pub fn exists(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// File names in sorted order, including unsynced creates and renames.
    pub fn list(&self) -> Vec<String> {
        self.names.keys().cloned().collect()
    }

    /// Sum of the lengths of all named files.
    pub fn used_bytes(&self) -> u64 {
        self.names
            .values()
            .map(|id| self.inodes[id].cached.len() as u64)
            .sum()
    }

    /// Limits [`used_bytes`](Self::used_bytes): a write or truncate that would grow it beyond
    /// `capacity_bytes` fails with [`DiskError::NoSpace`]. `None` removes the limit (files live in
    /// memory, so a stray huge offset then exhausts it). Lowering the limit below current use
    /// does not shrink files; it refuses further growth.
    pub fn set_capacity_bytes(&mut self, capacity_bytes: Option<u64>) {
        self.capacity_bytes = capacity_bytes;
    }

    /// The limit set by [`set_capacity_bytes`](Self::set_capacity_bytes).
    pub fn capacity_bytes(&self) -> Option<u64> {
        self.capacity_bytes
    }

    /// The next `count` operations that do I/O (create, write, read, truncate, delete, rename,
    /// sync, sync_dir) fail with [`DiskError::Io`] and change nothing; `len`, `exists`, `list` are
    /// unaffected. For random errors, call `fail_next_ops(1)` when `rng.chance(p)` in the harness.
    pub fn fail_next_ops(&mut self, count: u64) {
        self.fail_ops_remaining = count;
    }

    fn injected_fault(&mut self) -> Result<(), DiskError> {
        if self.fail_ops_remaining > 0 {
            self.fail_ops_remaining -= 1;
            return Err(DiskError::Io);
        }
        Ok(())
    }

    fn id(&self, name: &str) -> Result<FileId, DiskError> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| DiskError::NotFound(name.to_string()))
    }

    fn no_space(&self) -> DiskError {
        DiskError::NoSpace {
            capacity_bytes: self.capacity_bytes.unwrap_or(u64::MAX),
        }
    }

    /// Refuses to let file `id` grow to `new_len` if that would exceed the capacity.
    fn check_growth(&self, id: FileId, new_len: u64) -> Result<(), DiskError> {
        let growth = new_len.saturating_sub(self.inodes[&id].cached.len() as u64);
        match self.capacity_bytes {
            Some(capacity) if self.used_bytes().saturating_add(growth) > capacity => {
                Err(self.no_space())
            }
            _ => Ok(()),
        }
    }

    /// Forgets files that no name can reach any more, now or after a crash.
    fn drop_unnamed_inodes(&mut self) {
        let live: BTreeSet<FileId> = self
            .names
            .values()
            .chain(self.durable_names.values())
            .copied()
            .collect();
        self.inodes.retain(|id, _| live.contains(id));
    }
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).expect("file length fits in memory (bounded by capacity_bytes)")
}

fn apply_write(buf: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let (start, end) = (to_usize(offset), to_usize(offset) + data.len());
    if buf.len() < end {
        buf.resize(end, 0);
    }
    buf[start..end].copy_from_slice(data);
}

/// Applies some but not all of the sectors the write covers (a write within one sector is
/// applied or not), so a torn write is always distinguishable from a kept or lost one.
fn tear_write(rng: &mut SimRng, buf: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset + data.len() as u64;
    let first_sector = offset / SECTOR_BYTES;
    let sector_count = (end - 1) / SECTOR_BYTES - first_sector + 1;
    let mut sectors: Vec<u64> = (first_sector..first_sector + sector_count).collect();
    rng.shuffle(&mut sectors);
    let applied_count = if sector_count == 1 {
        rng.range_u64(0, 1)
    } else {
        rng.range_u64(1, sector_count - 1)
    };
    for sector in &sectors[..applied_count as usize] {
        let (from, to) = (
            (sector * SECTOR_BYTES).max(offset),
            ((sector + 1) * SECTOR_BYTES).min(end),
        );
        apply_write(
            buf,
            from,
            &data[(from - offset) as usize..(to - offset) as usize],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEEDS: u64 = 300;

    /// A disk holding `name` with `content`, fully durable.
    fn durable_file(name: &str, content: &[u8]) -> SimDisk {
        let mut disk = SimDisk::new();
        disk.create(name).unwrap();
        disk.write(name, 0, content).unwrap();
        disk.sync(name).unwrap();
        disk.sync_dir().unwrap();
        disk
    }

    #[test]
    fn reads_see_unsynced_data_zero_filled_holes_and_stop_at_eof() {
        let mut disk = SimDisk::new();
        disk.create("f").unwrap();
        disk.write("f", 4, b"abc").unwrap();
        assert_eq!(disk.read("f", 0, 100).unwrap(), b"\0\0\0\0abc");
        assert_eq!(disk.read("f", 5, 1).unwrap(), b"b");
        assert_eq!(disk.read("f", 50, 10).unwrap(), b"");
        disk.truncate("f", 5).unwrap();
        assert_eq!(disk.len("f").unwrap(), 5);
        disk.rename("f", "g").unwrap();
        disk.create("a").unwrap();
        assert_eq!(disk.list(), vec!["a", "g"]);
        disk.delete("g").unwrap();
        assert!(!disk.exists("g"));
        assert_eq!(disk.read("g", 0, 1), Err(DiskError::NotFound("g".into())));
        assert_eq!(
            disk.write("g", 0, b"x"),
            Err(DiskError::NotFound("g".into()))
        );
    }

    #[test]
    fn unsynced_write_is_kept_lost_or_torn_by_whole_sectors() {
        let (old, new) = (vec![1u8; 4 * 512], vec![2u8; 4 * 512]);
        let (mut kept, mut lost, mut torn) = (0, 0, 0);
        for seed in 0..SEEDS {
            let mut disk = durable_file("f", &old);
            disk.write("f", 0, &new).unwrap();
            disk.crash(&mut SimRng::new(seed));
            let after = disk.read("f", 0, 4096).unwrap();
            assert_eq!(after.len(), 4 * 512);
            for sector in after.chunks(512) {
                assert!(
                    sector == &old[..512] || sector == &new[..512],
                    "seed {seed}: a sector was torn inside"
                );
            }
            match after {
                a if a == new => kept += 1,
                a if a == old => lost += 1,
                _ => torn += 1,
            }
        }
        assert!(
            kept > 0 && lost > 0 && torn > 0,
            "kept {kept} lost {lost} torn {torn}"
        );
    }

    #[test]
    fn torn_write_applies_some_but_not_all_absolute_sectors() {
        // Bytes 256..1280 touch sectors 0, 1 and 2 partially; each region tears as a unit.
        for seed in 0..SEEDS {
            let mut buf = vec![1u8; 1536];
            tear_write(&mut SimRng::new(seed), &mut buf, 256, &[2; 1024]);
            let regions = [&buf[256..512], &buf[512..1024], &buf[1024..1280]];
            assert!(
                regions.iter().all(|r| r.iter().all(|&b| b == r[0])),
                "seed {seed}"
            );
            let applied = regions.iter().filter(|r| r[0] == 2).count();
            assert!(
                (1..=2).contains(&applied),
                "seed {seed}: {applied} of 3 sectors applied"
            );
            assert!(buf[..256].iter().chain(&buf[1280..]).all(|&b| b == 1));
        }
    }

    #[test]
    fn synced_data_always_survives_a_crash() {
        for seed in 0..SEEDS {
            let mut disk = durable_file("f", b"durable bytes");
            disk.create("other").unwrap(); // unsynced activity around it
            disk.write("other", 0, &[7; 1000]).unwrap();
            disk.crash(&mut SimRng::new(seed));
            assert_eq!(
                disk.read("f", 0, 100).unwrap(),
                b"durable bytes",
                "seed {seed}"
            );
            assert_eq!(disk.list().first().map(String::as_str), Some("f"));
        }
    }

    #[test]
    fn unsynced_create_may_be_lost_and_truncate_may_be_undone() {
        let (mut created, mut not_created, mut truncated, mut not_truncated) = (0, 0, 0, 0);
        for seed in 0..SEEDS {
            let mut disk = durable_file("f", b"0123456789");
            disk.create("new").unwrap();
            disk.truncate("f", 3).unwrap();
            disk.crash(&mut SimRng::new(seed));
            if disk.exists("new") {
                created += 1
            } else {
                not_created += 1
            }
            match disk.read("f", 0, 100).unwrap().as_slice() {
                b"012" => truncated += 1,
                b"0123456789" => not_truncated += 1,
                other => panic!("seed {seed}: unexpected contents {other:?}"),
            }
        }
        assert!(created > 0 && not_created > 0 && truncated > 0 && not_truncated > 0);
    }

    #[test]
    fn unsynced_rename_may_be_lost_but_never_mixes_contents() {
        let (mut renamed, mut not_renamed) = (0, 0);
        for seed in 0..SEEDS {
            let mut disk = durable_file("data", b"old");
            disk.create("data.tmp").unwrap();
            disk.write("data.tmp", 0, b"new").unwrap();
            disk.sync("data.tmp").unwrap();
            disk.sync_dir().unwrap();
            disk.rename("data.tmp", "data").unwrap();
            assert_eq!(disk.read("data", 0, 3).unwrap(), b"new");
            disk.crash(&mut SimRng::new(seed));
            match disk.read("data", 0, 3).unwrap().as_slice() {
                b"new" => renamed += 1,
                b"old" => not_renamed += 1,
                other => panic!("seed {seed}: unexpected contents {other:?}"),
            }
            assert_eq!(
                disk.exists("data.tmp"),
                disk.read("data", 0, 3).unwrap() == b"old"
            );
        }
        assert!(
            renamed > 0 && not_renamed > 0,
            "renamed {renamed} not renamed {not_renamed}"
        );

        let mut disk = durable_file("data", b"old");
        disk.create("data.tmp").unwrap();
        disk.write("data.tmp", 0, b"new").unwrap();
        disk.sync("data.tmp").unwrap();
        disk.rename("data.tmp", "data").unwrap();
        disk.sync_dir().unwrap();
        disk.crash(&mut SimRng::new(0));
        assert_eq!(disk.read("data", 0, 3).unwrap(), b"new");
        assert_eq!(disk.list(), vec!["data"]);
    }

    #[test]
    fn capacity_limit_returns_no_space_and_leaves_contents_unchanged() {
        let mut disk = SimDisk::new();
        disk.set_capacity_bytes(Some(1000));
        disk.create("a").unwrap();
        disk.write("a", 0, &[1; 600]).unwrap();
        assert_eq!(
            disk.write("a", 500, &[2; 501]),
            Err(DiskError::NoSpace {
                capacity_bytes: 1000
            })
        );
        assert_eq!(
            disk.truncate("a", 1001),
            Err(DiskError::NoSpace {
                capacity_bytes: 1000
            })
        );
        assert_eq!(disk.read("a", 0, 2000).unwrap(), vec![1; 600]);
        disk.write("a", 0, &[3; 600]).unwrap(); // overwrite needs no space
        disk.create("b").unwrap();
        disk.write("b", 0, &[4; 400]).unwrap(); // exactly at the limit
        assert_eq!(disk.used_bytes(), 1000);
        assert!(matches!(
            disk.write("b", 400, &[5]),
            Err(DiskError::NoSpace { .. })
        ));
        assert_eq!(
            disk.write("a", u64::MAX, &[1]),
            Err(DiskError::NoSpace {
                capacity_bytes: 1000
            })
        );
        disk.delete("a").unwrap();
        disk.write("b", 400, &[5]).unwrap();
    }

    #[test]
    fn injected_io_errors_fail_the_next_ops_and_change_nothing() {
        let mut disk = durable_file("f", b"abc");
        disk.fail_next_ops(2);
        assert_eq!(disk.write("f", 0, b"xyz"), Err(DiskError::Io));
        assert_eq!(disk.sync("f"), Err(DiskError::Io));
        assert_eq!(disk.len("f").unwrap(), 3); // metadata calls do not consume faults
        assert_eq!(disk.read("f", 0, 3).unwrap(), b"abc");
    }
}
