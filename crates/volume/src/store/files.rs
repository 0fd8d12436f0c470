//! The file operations the store needs, behind one small trait so the same store runs on a real
//! file system ([`RealFs`], what shards run) and on the simulator's disk ([`SimFs`], what the
//! seeded simulation and the model tests run), whose crashes lose and tear unsynced writes.
//!
//! [`StoreFs`] is a directory tree of files named by path; its [`StoreFs::File`] is an open file
//! with positional reads and writes and `fdatasync` (the journal's [`JournalFile`], so the
//! journal runs on either) plus what slot files need beyond that: their length, a read of a run
//! of bytes into a fresh vector, hole detection and the writeback hints of the checkpoint.
//!
//! What the simulated disk cannot model stays out of it, with the reason where it is decided:
//! holes (the simulated disk zero-fills a gap, so a slot whose creation a crash interrupted
//! shows only by its length or header: [`SlotFile::has_hole`] is false there), writeback without
//! a device flush (there is no device cache: [`SlotFile::wait_writeback`] is the sync it amounts
//! to once the journal's flush follows), free space of a file system (the disk's capacity less
//! its files), directories (one flat namespace whose every create, delete and rename one
//! `sync_dir` makes durable; the store's directories are only names that exist once made). The
//! store's threads — the background refill, the journal checkpoint — are the store's own choice
//! ([`super::PoolOptions::background_refill`], the journal); the simulation turns them off, and
//! the shard driver's blocking pool that runs commands stays in the driver.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use sim::{DiskError, SimDisk, SimRng};

use super::journal::JournalFile;

/// An open file of the store (a slot file, the journal, the state file).
pub trait SlotFile: JournalFile + Sized {
    /// The file's length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Up to `len` bytes from `offset` (short at the end of the file).
    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>>;
    /// Whether the file has a hole before `len` (blocks never written).
    fn has_hole(&self, len: u64) -> bool;
    /// Starts writeback of the file's dirty pages without waiting.
    fn start_writeback(&self);
    /// Writes back the file's dirty pages and waits until the device has them (a device flush
    /// must follow for durability).
    fn wait_writeback(&self) -> io::Result<()>;
}

/// A directory tree of the store's files.
pub trait StoreFs: Send + Sync + 'static {
    type File: SlotFile;
    fn exists(&self, path: &Path) -> bool;
    fn is_dir(&self, path: &Path) -> bool;
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable (fsync of the directory).
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// The names in a directory and their paths.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<(String, PathBuf)>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Self::File>;
    /// Opens an existing file for reading.
    fn open_read(&self, path: &Path) -> io::Result<Self::File>;
    /// Creates a file that must not exist yet, for reading and writing.
    fn create_new(&self, path: &Path) -> io::Result<Self::File>;
    /// Creates or empties a file, for reading and writing.
    fn create_truncate(&self, path: &Path) -> io::Result<Self::File>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    fn remove_dir(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// A whole file's bytes.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Bytes of the file system holding `path` that an unprivileged writer may still use.
    fn available_bytes(&self, path: &Path) -> io::Result<u64>;
}

/// The real file system: `pread`/`pwrite`, `fdatasync`, `sync_file_range`, `SEEK_HOLE`,
/// `statvfs`, directory fsync.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl SlotFile for File {
    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        // Read into uninitialised capacity (`read_to_end` does not zero it first): on the
        // copy-on-write path every pass over the object's bytes shows in the latency.
        let mut buf = Vec::with_capacity(len as usize);
        let mut f = self;
        f.seek(SeekFrom::Start(offset))?;
        f.take(len).read_to_end(&mut buf)?;
        Ok(buf)
    }

    fn has_hole(&self, len: u64) -> bool {
        // File systems without hole reporting say "no".
        // SAFETY: lseek on a valid open descriptor with plain integer arguments.
        let at = unsafe { libc::lseek(self.as_raw_fd(), 0, libc::SEEK_HOLE) };
        at >= 0 && (at as u64) < len
    }

    fn start_writeback(&self) {
        // SAFETY: sync_file_range on a valid open descriptor with plain integer arguments; failure
        // only loses the optimisation (the fdatasync after it is what makes the file durable).
        unsafe {
            libc::sync_file_range(self.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
        }
    }

    fn wait_writeback(&self) -> io::Result<()> {
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: sync_file_range on a valid open descriptor with plain integer arguments.
        if unsafe { libc::sync_file_range(self.as_raw_fd(), 0, 0, flags) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl StoreFs for RealFs {
    type File = File;

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        fs::create_dir_all(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<(String, PathBuf)>> {
        let mut out = vec![];
        for dirent in fs::read_dir(path)? {
            let dirent = dirent?;
            out.push((dirent.file_name().to_string_lossy().into_owned(), dirent.path()));
        }
        Ok(out)
    }

    fn open(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().read(true).write(true).open(path)
    }

    fn open_read(&self, path: &Path) -> io::Result<File> {
        File::open(path)
    }

    fn create_new(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().read(true).write(true).create_new(true).open(path)
    }

    fn create_truncate(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        fs::remove_dir(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn available_bytes(&self, path: &Path) -> io::Result<u64> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: `c` is a valid NUL-terminated path; `st` is plain data the call fills in.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: both pointers are valid for the duration of the call.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

/// The simulator's disk ([`SimDisk`]) as the store's file system, shared by the store and the
/// test that crashes it (clones share one disk). A path is a file's name on the disk.
///
/// Besides the disk's own crash ([`SimFs::crash`]), it can cut the power in the middle of a
/// command ([`SimFs::cut_power_after`]): the next few I/O operations succeed, every later one
/// fails and changes nothing, as when the machine stops between two system calls. A crash
/// afterwards then loses or tears whatever of them was not synced — so a simulated crash can
/// land anywhere inside the store's sequence of writes and syncs.
#[derive(Clone, Default)]
pub struct SimFs {
    state: Arc<Mutex<SimFsState>>,
}

#[derive(Default)]
struct SimFsState {
    disk: SimDisk,
    /// Directories made (not crash-modelled: the disk has one flat namespace, so a directory is
    /// only a prefix of names; see the module documentation).
    dirs: BTreeSet<String>,
    /// I/O operations left before the power cut, if one is armed.
    power_left: Option<u64>,
    /// The names of the open files: a rename renames them too, as an open descriptor follows
    /// its inode (the journal is formatted under a temporary name and used after the rename).
    open_names: Vec<Weak<Mutex<String>>>,
}

impl SimFsState {
    /// Counts one I/O operation against an armed power cut.
    fn io(&mut self) -> io::Result<&mut SimDisk> {
        match &mut self.power_left {
            Some(0) => Err(io::Error::other("the simulated machine lost power")),
            Some(n) => {
                *n -= 1;
                Ok(&mut self.disk)
            }
            None => Ok(&mut self.disk),
        }
    }
}

fn name(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn sim_err(e: DiskError) -> io::Error {
    match e {
        DiskError::NotFound(n) => io::Error::new(ErrorKind::NotFound, format!("{n} not found")),
        DiskError::NoSpace { .. } => io::Error::from_raw_os_error(libc::ENOSPC),
        e => io::Error::other(e.to_string()),
    }
}

impl SimFs {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, SimFsState> {
        self.state.lock().unwrap()
    }

    /// Power loss: see [`SimDisk::crash`]. Lifts any power cut (the machine restarts).
    pub fn crash(&self, rng: &mut SimRng) {
        let mut s = self.lock();
        s.power_left = None;
        s.disk.crash(rng);
    }

    /// Cuts the power after `ops` more I/O operations (see [`SimFs`]), until [`SimFs::crash`].
    pub fn cut_power_after(&self, ops: u64) {
        self.lock().power_left = Some(ops);
    }

    /// Whether an armed power cut has been reached (operations fail).
    pub fn power_is_cut(&self) -> bool {
        self.lock().power_left == Some(0)
    }

    /// Runs `f` on the disk itself (for tests: capacity, injected errors, listings).
    pub fn with_disk<T>(&self, f: impl FnOnce(&mut SimDisk) -> T) -> T {
        f(&mut self.lock().disk)
    }
}

/// An open file on a [`SimFs`]: the disk's file of that name (following renames).
pub struct SimFile {
    fs: SimFs,
    name: Arc<Mutex<String>>,
}

impl SimFs {
    fn handle(&self, s: &mut SimFsState, name: String) -> SimFile {
        let name = Arc::new(Mutex::new(name));
        s.open_names.retain(|w| w.strong_count() > 0);
        s.open_names.push(Arc::downgrade(&name));
        SimFile { fs: self.clone(), name }
    }
}

impl SimFile {
    fn name(&self) -> String {
        self.name.lock().unwrap().clone()
    }
}

impl JournalFile for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let name = self.name();
        let d = self.fs.lock().io()?.read(&name, offset, buf.len() as u64).map_err(sim_err)?;
        buf[..d.len()].copy_from_slice(&d);
        Ok(d.len())
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let name = self.name();
        self.fs.lock().io()?.write(&name, offset, data).map_err(sim_err)
    }

    fn sync(&self) -> io::Result<()> {
        let name = self.name();
        self.fs.lock().io()?.sync(&name).map_err(sim_err)
    }
}

impl SlotFile for SimFile {
    fn len(&self) -> io::Result<u64> {
        let name = self.name();
        self.fs.lock().disk.len(&name).map_err(sim_err)
    }

    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let name = self.name();
        self.fs.lock().io()?.read(&name, offset, len).map_err(sim_err)
    }

    fn has_hole(&self, _len: u64) -> bool {
        // The simulated disk zero-fills gaps: it has no holes (see the module documentation).
        false
    }

    fn start_writeback(&self) {}

    fn wait_writeback(&self) -> io::Result<()> {
        // No device cache: written back and then flushed by the journal's sync is synced.
        self.sync()
    }
}

impl StoreFs for SimFs {
    type File = SimFile;

    fn exists(&self, path: &Path) -> bool {
        let s = self.lock();
        s.disk.exists(&name(path)) || s.dirs.contains(&name(path))
    }

    fn is_dir(&self, path: &Path) -> bool {
        self.lock().dirs.contains(&name(path))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.io()?;
        for p in path.ancestors().filter(|p| !p.as_os_str().is_empty()) {
            s.dirs.insert(name(p));
        }
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        if !s.dirs.contains(&name(path)) {
            return Err(io::Error::new(ErrorKind::NotFound, format!("directory {} not found", path.display())));
        }
        s.io()?.sync_dir().map_err(sim_err)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<(String, PathBuf)>> {
        let mut s = self.lock();
        let dir = name(path);
        if !s.dirs.contains(&dir) {
            return Err(io::Error::new(ErrorKind::NotFound, format!("directory {dir} not found")));
        }
        let prefix = format!("{dir}/");
        let files = s.io()?.list();
        let mut names: BTreeSet<String> = files
            .iter()
            .chain(s.dirs.iter())
            .filter_map(|n| n.strip_prefix(&prefix))
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
            .map(str::to_string)
            .collect();
        // Subdirectories that hold files but were never made explicitly do not exist.
        names.retain(|n| s.disk.exists(&format!("{prefix}{n}")) || s.dirs.contains(&format!("{prefix}{n}")));
        Ok(names.into_iter().map(|n| (n.clone(), path.join(n))).collect())
    }

    fn open(&self, path: &Path) -> io::Result<SimFile> {
        let n = name(path);
        let mut s = self.lock();
        s.io()?;
        if !s.disk.exists(&n) {
            return Err(io::Error::new(ErrorKind::NotFound, format!("{n} not found")));
        }
        Ok(self.handle(&mut s, n))
    }

    fn open_read(&self, path: &Path) -> io::Result<SimFile> {
        self.open(path)
    }

    fn create_new(&self, path: &Path) -> io::Result<SimFile> {
        let n = name(path);
        let mut s = self.lock();
        if s.disk.exists(&n) {
            return Err(io::Error::new(ErrorKind::AlreadyExists, format!("{n} exists")));
        }
        s.io()?.create(&n).map_err(sim_err)?;
        Ok(self.handle(&mut s, n))
    }

    fn create_truncate(&self, path: &Path) -> io::Result<SimFile> {
        let n = name(path);
        let mut s = self.lock();
        let disk = s.io()?;
        disk.create(&n).map_err(sim_err)?;
        disk.truncate(&n, 0).map_err(sim_err)?;
        Ok(self.handle(&mut s, n))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.lock().io()?.delete(&name(path)).map_err(sim_err)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.io()?;
        s.dirs.remove(&name(path));
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from, to) = (name(from), name(to));
        let mut s = self.lock();
        s.io()?.rename(&from, &to).map_err(sim_err)?;
        for open in s.open_names.iter().filter_map(Weak::upgrade) {
            let mut n = open.lock().unwrap();
            if *n == from {
                *n = to.clone();
            }
        }
        Ok(())
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let n = name(path);
        let mut s = self.lock();
        let len = s.disk.len(&n).map_err(sim_err)?;
        s.io()?.read(&n, 0, len).map_err(sim_err)
    }

    fn available_bytes(&self, _path: &Path) -> io::Result<u64> {
        let s = self.lock();
        Ok(s.disk.capacity_bytes().unwrap_or(u64::MAX).saturating_sub(s.disk.used_bytes()))
    }
}
