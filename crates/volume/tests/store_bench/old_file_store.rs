//! The one-file-per-object store as it was before slot files (commit 1bd5212,
//! crates/volume/src/store/mod.rs), kept here only so the benchmark can compare both on the same
//! disk at the same moment.
//!
//! Original description: one file per object, durable on return.
//!
//! Layout under the data directory:
//! `objects/<table>/<objno>.<owner>` (hex), each file in the format of [`volume::store::objfmt`]
//! (a header with the version and block checksums, then the bytes), and `state` (the shard's
//! tracking list, replaced atomically). Every mutation is followed by
//! `fdatasync`, and creations, renames and deletions by an `fsync` of the directory, before it is
//! reported done: a shard acknowledges only durable writes.

#![allow(dead_code)]

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use volume::store::objfmt::{self, ObjFile, HEADER_BYTES};
use volume::core::shard::{Boot, DiskCmd, DiskErr, DiskOut};
use volume::types::*;

/// A real object file.
struct RealFile<'a>(&'a File);

impl ObjFile for RealFile<'_> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.0.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
    fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.0.write_all_at(data, offset)
    }
    fn len(&mut self) -> std::io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn set_len(&mut self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn zero_range(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        punch_hole(self.0, offset, len)
    }
}

pub struct OldFileStore {
    root: PathBuf,
    /// Highest state sequence written, so an older snapshot never replaces a newer one.
    state_seq: Mutex<u64>,
}

fn disk_err(e: std::io::Error) -> DiskErr {
    if e.raw_os_error() == Some(libc::ENOSPC) || e.kind() == ErrorKind::StorageFull {
        DiskErr::NoSpace
    } else {
        DiskErr::Io(e.to_string())
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl OldFileStore {
    /// Opens (creating if asked) a shard data directory.
    pub fn open(root: &Path, create: bool) -> Result<Self, String> {
        if !root.exists() {
            if !create {
                return Err(format!(
                    "data directory {} does not exist (pass --create to make a new shard)",
                    root.display()
                ));
            }
            fs::create_dir_all(root.join("objects")).map_err(|e| format!("cannot create {}: {e}", root.display()))?;
        }
        if !root.join("objects").is_dir() {
            fs::create_dir_all(root.join("objects"))
                .map_err(|e| format!("{} is not a shard data directory: {e}", root.display()))?;
        }
        Ok(OldFileStore { root: root.to_path_buf(), state_seq: Mutex::new(0) })
    }

    fn table_dir(&self, table: TableId) -> PathBuf {
        self.root.join("objects").join(format!("{table:016x}"))
    }

    fn path(&self, key: &ObjKey) -> PathBuf {
        self.table_dir(key.table).join(format!("{:016x}.{:016x}", key.objno, key.owner))
    }

    fn parse_name(table: TableId, name: &str) -> Option<ObjKey> {
        let (objno, owner) = name.split_once('.')?;
        Some(ObjKey {
            table,
            objno: u64::from_str_radix(objno, 16).ok()?,
            owner: u64::from_str_radix(owner, 16).ok()?,
        })
    }

    /// Scans the store: every object with its version (checked against its checksums, see
    /// [`objfmt`]), the tracking objects' contents, the state.
    pub fn boot(&self) -> std::io::Result<Boot> {
        let mut boot = Boot::default();
        for t in fs::read_dir(self.root.join("objects"))? {
            let t = t?;
            let Ok(table) = u64::from_str_radix(&t.file_name().to_string_lossy(), 16) else { continue };
            for o in fs::read_dir(t.path())? {
                let o = o?;
                let name = o.file_name().to_string_lossy().to_string();
                let Some(key) = Self::parse_name(table, &name) else {
                    // Leftover temporary files of an interrupted copy.
                    let _ = fs::remove_file(o.path());
                    continue;
                };
                let f = File::open(o.path())?;
                let version = objfmt::verify(&mut RealFile(&f))?;
                if version == objfmt::SUSPECT {
                    tracing::warn!("object {key:?} does not match its checksums (interrupted write): it will be re-replicated");
                }
                boot.objects.push((key, version));
                if key.objno == TRACK_OBJNO && version != objfmt::SUSPECT {
                    boot.track_objects.push((key, objfmt::read_body(&mut RealFile(&f))?));
                }
            }
        }
        match fs::read(self.root.join("state")) {
            Ok(b) => boot.state = Some(b),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(boot)
    }

    /// Runs one disk command (blocking).
    pub fn run(&self, cmd: DiskCmd) -> Result<DiskOut, DiskErr> {
        match cmd {
            DiskCmd::Read { key, offset, len } => {
                let mut buf = vec![0u8; len as usize];
                match File::open(self.path(&key)) {
                    Ok(f) => {
                        RealFile(&f).read_at(&mut buf, HEADER_BYTES + offset as u64).map_err(disk_err)?;
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(disk_err(e)),
                }
                Ok(DiskOut::Data(buf))
            }
            DiskCmd::ReadAll { key } => {
                let f = File::open(self.path(&key)).map_err(disk_err)?;
                Ok(DiskOut::Data(objfmt::read_body(&mut RealFile(&f)).map_err(disk_err)?))
            }
            DiskCmd::Apply { key, version, op, cow_from } => {
                self.apply(key, version, op, cow_from).map_err(disk_err)?;
                Ok(DiskOut::Done)
            }
            DiskCmd::Delete { key } => {
                let p = self.path(&key);
                match fs::remove_file(&p) {
                    Ok(()) => sync_dir(p.parent().unwrap()).map_err(disk_err)?,
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(disk_err(e)),
                }
                Ok(DiskOut::Done)
            }
            DiskCmd::Rename { from, to } => {
                let (pf, pt) = (self.path(&from), self.path(&to));
                fs::rename(&pf, &pt).map_err(disk_err)?;
                sync_dir(pt.parent().unwrap()).map_err(disk_err)?;
                Ok(DiskOut::Done)
            }
            DiskCmd::Prestock { .. } => Ok(DiskOut::Done),
            DiskCmd::SaveState { seq, bytes } => {
                let mut last = self.state_seq.lock().unwrap();
                if seq > *last {
                    let tmp = self.root.join("state.tmp");
                    let mut f = File::create(&tmp).map_err(disk_err)?;
                    f.write_all(&bytes).map_err(disk_err)?;
                    f.sync_data().map_err(disk_err)?;
                    fs::rename(&tmp, self.root.join("state")).map_err(disk_err)?;
                    sync_dir(&self.root).map_err(disk_err)?;
                    *last = seq;
                }
                Ok(DiskOut::Done)
            }
        }
    }

    fn apply(&self, key: ObjKey, version: Version, op: RepOp, cow_from: Option<ObjKey>) -> std::io::Result<()> {
        let path = self.path(&key);
        let dir = path.parent().unwrap().to_path_buf();
        let mut created = false;
        if !dir.exists() {
            fs::create_dir_all(&dir)?;
            sync_dir(&self.root.join("objects"))?;
        }
        if let Some(src) = cow_from {
            if !path.exists() {
                // Collocated copy-on-write: a local copy, no network transfer (§4.2.1). Copy to
                // a temporary name first so a crash never leaves a half-copied object.
                let tmp = dir.join(format!("{:016x}.{:016x}.cow", key.objno, key.owner));
                fs::copy(self.path(&src), &tmp)?;
                fs::rename(&tmp, &path)?;
                created = true;
            }
        }
        let f = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                created = true;
                OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?
            }
            Err(e) => return Err(e),
        };
        objfmt::apply(&mut RealFile(&f), version, &op)?;
        f.sync_data()?;
        if created {
            sync_dir(&dir)?;
        }
        Ok(())
    }
}

fn punch_hole(f: &File, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: fallocate on a valid open descriptor with plain integer arguments.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        // File systems without hole punching: write the zeroes.
        return f.write_all_at(&vec![0u8; len as usize], offset);
    }
    Err(e)
}

