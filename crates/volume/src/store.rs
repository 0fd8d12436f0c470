//! The shard's local object store: one file per object, durable on return.
//!
//! Layout under the data directory:
//! `objects/<table>/<objno>.<owner>` (hex), each file in the format of [`crate::objfmt`]
//! (a header with the version and block checksums, then the bytes), and `state` (the shard's
//! tracking list, replaced atomically). Every mutation is followed by
//! `fdatasync`, and creations, renames and deletions by an `fsync` of the directory, before it is
//! reported done: a shard acknowledges only durable writes.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::objfmt::{self, ObjFile, HEADER_BYTES};
use crate::shard_core::{Boot, DiskCmd, DiskErr, DiskOut};
use crate::types::*;

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

pub struct FileStore {
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

impl FileStore {
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
        Ok(FileStore { root: root.to_path_buf(), state_seq: Mutex::new(0) })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key(objno: u64, owner: u64) -> ObjKey {
        ObjKey { table: 7, objno, owner }
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

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("understudy-store-{}-{}", std::process::id(), rand::random::<u32>()));
        fs::create_dir_all(&d).unwrap();
        d
    }
}
