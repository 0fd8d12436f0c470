//! The shard's object store on the simulator's disk, for the simulation tests: one file per
//! object in the format of [`crate::objfmt`] (version and block checksums), with the same
//! semantics as the real [`crate::store::FileStore`] (which keeps objects in pre-allocated slot
//! files instead; both apply mutations through `objfmt::apply`). The disk crashes, loses unsynced
//! writes and tears them.
//!
//! A command is split in two: [`SimStore::start`] makes its changes (unsynced, as the page cache
//! would hold them) and [`SimStore::finish`] syncs them; a crash in between loses or tears them.

use sim::{DiskError, SimDisk};

use crate::objfmt::{self, ObjFile, HEADER_BYTES};
use crate::shard_core::{Boot, DiskCmd, DiskErr, DiskOut};
use crate::types::*;

/// An object file on the simulated disk.
struct SimFile<'a> {
    disk: &'a mut SimDisk,
    name: &'a str,
}

fn io_err(e: DiskError) -> std::io::Error {
    match e {
        DiskError::NoSpace { .. } => std::io::Error::from_raw_os_error(28),
        e => std::io::Error::other(e.to_string()),
    }
}

impl ObjFile for SimFile<'_> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let d = self.disk.read(self.name, offset, buf.len() as u64).map_err(io_err)?;
        buf[..d.len()].copy_from_slice(&d);
        Ok(d.len())
    }
    fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.disk.write(self.name, offset, data).map_err(io_err)
    }
    fn len(&mut self) -> std::io::Result<u64> {
        self.disk.len(self.name).map_err(io_err)
    }
    fn set_len(&mut self, len: u64) -> std::io::Result<()> {
        self.disk.truncate(self.name, len).map_err(io_err)
    }
    fn zero_range(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        self.disk.write(self.name, offset, &vec![0u8; len as usize]).map_err(io_err)
    }
}

fn ioe(e: std::io::Error) -> DiskErr {
    if e.raw_os_error() == Some(28) {
        DiskErr::NoSpace
    } else {
        DiskErr::Io(e.to_string())
    }
}

fn name(key: &ObjKey) -> String {
    format!("o/{:016x}/{:016x}.{:016x}", key.table, key.objno, key.owner)
}

fn parse(name: &str) -> Option<ObjKey> {
    let rest = name.strip_prefix("o/")?;
    let (table, file) = rest.split_once('/')?;
    let (objno, owner) = file.split_once('.')?;
    Some(ObjKey {
        table: u64::from_str_radix(table, 16).ok()?,
        objno: u64::from_str_radix(objno, 16).ok()?,
        owner: u64::from_str_radix(owner, 16).ok()?,
    })
}

fn err(e: DiskError) -> DiskErr {
    match e {
        DiskError::NoSpace { .. } => DiskErr::NoSpace,
        e => DiskErr::Io(e.to_string()),
    }
}

/// What `finish` must sync for a started command.
#[derive(Debug, Clone)]
pub struct Started {
    files: Vec<String>,
    dir: bool,
    result: Result<DiskOut, DiskErr>,
}

#[derive(Default)]
pub struct SimStore {
    pub disk: SimDisk,
    state_seq: u64,
}

impl SimStore {
    pub fn boot(&mut self) -> Boot {
        let mut boot = Boot::default();
        for n in self.disk.list() {
            if let Some(key) = parse(&n) {
                let version = objfmt::verify(&mut SimFile { disk: &mut self.disk, name: &n }).unwrap_or(objfmt::SUSPECT);
                boot.objects.push((key, version));
                if key.objno == TRACK_OBJNO && version != objfmt::SUSPECT {
                    boot.track_objects.push((key, self.read_body(&n)));
                }
            } else if n.ends_with(".cow") {
                let _ = self.disk.delete(&n);
            }
        }
        if self.disk.exists("state") {
            let len = self.disk.len("state").unwrap_or(0);
            boot.state = self.disk.read("state", 0, len).ok();
        }
        self.state_seq = 0;
        boot
    }

    fn read_body(&mut self, n: &str) -> Vec<u8> {
        objfmt::read_body(&mut SimFile { disk: &mut self.disk, name: n }).unwrap_or_default()
    }

    /// Reads an object's bytes (for test checks).
    pub fn object_bytes(&mut self, key: &ObjKey) -> Option<Vec<u8>> {
        let n = name(key);
        self.disk.exists(&n).then(|| self.read_body(&n))
    }

    pub fn start(&mut self, cmd: DiskCmd) -> Started {
        let mut files = vec![];
        let mut dir = false;
        let result = self.start_inner(cmd, &mut files, &mut dir);
        Started { files, dir, result }
    }

    pub fn finish(&mut self, s: Started) -> Result<DiskOut, DiskErr> {
        if s.result.is_ok() {
            for f in &s.files {
                if self.disk.exists(f) {
                    self.disk.sync(f).map_err(err)?;
                }
            }
            if s.dir {
                self.disk.sync_dir().map_err(err)?;
            }
        }
        s.result
    }

    fn start_inner(&mut self, cmd: DiskCmd, files: &mut Vec<String>, dir: &mut bool) -> Result<DiskOut, DiskErr> {
        match cmd {
            DiskCmd::Read { key, offset, len } => {
                let n = name(&key);
                let mut buf = vec![0u8; len as usize];
                if self.disk.exists(&n) {
                    let d = self.disk.read(&n, HEADER_BYTES + offset as u64, len as u64).map_err(err)?;
                    buf[..d.len()].copy_from_slice(&d);
                }
                Ok(DiskOut::Data(buf))
            }
            DiskCmd::ReadAll { key } => {
                let n = name(&key);
                if !self.disk.exists(&n) {
                    return Err(DiskErr::Io(format!("{n} not found")));
                }
                Ok(DiskOut::Data(self.read_body(&n)))
            }
            DiskCmd::Apply { key, version, op, cow_from } => {
                let n = name(&key);
                if let Some(src) = cow_from {
                    if !self.disk.exists(&n) {
                        let sn = name(&src);
                        let len = self.disk.len(&sn).map_err(err)?;
                        let bytes = self.disk.read(&sn, 0, len).map_err(err)?;
                        let tmp = format!("{n}.cow");
                        self.disk.create(&tmp).map_err(err)?;
                        self.disk.write(&tmp, 0, &bytes).map_err(err)?;
                        self.disk.sync(&tmp).map_err(err)?;
                        self.disk.rename(&tmp, &n).map_err(err)?;
                        *dir = true;
                    }
                }
                if !self.disk.exists(&n) {
                    self.disk.create(&n).map_err(err)?;
                    *dir = true;
                }
                objfmt::apply(&mut SimFile { disk: &mut self.disk, name: &n }, version, &op).map_err(ioe)?;
                files.push(n);
                Ok(DiskOut::Done)
            }
            DiskCmd::Delete { key } => {
                let n = name(&key);
                if self.disk.exists(&n) {
                    self.disk.delete(&n).map_err(err)?;
                    *dir = true;
                }
                Ok(DiskOut::Done)
            }
            DiskCmd::Rename { from, to } => {
                self.disk.rename(&name(&from), &name(&to)).map_err(err)?;
                *dir = true;
                Ok(DiskOut::Done)
            }
            DiskCmd::SaveState { seq, bytes } => {
                if seq > self.state_seq {
                    self.disk.create("state.tmp").map_err(err)?;
                    self.disk.truncate("state.tmp", 0).map_err(err)?;
                    self.disk.write("state.tmp", 0, &bytes).map_err(err)?;
                    self.disk.sync("state.tmp").map_err(err)?;
                    self.disk.rename("state.tmp", "state").map_err(err)?;
                    self.state_seq = seq;
                    *dir = true;
                }
                Ok(DiskOut::Done)
            }
        }
    }
}
