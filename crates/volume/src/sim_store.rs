//! The shard's object store on the simulator's disk, for the simulation tests: one file per
//! object in the format of [`crate::store::objfmt`] (version and block checksums), with the same
//! semantics as the real [`crate::store::FileStore`] (which keeps objects in pre-allocated slot
//! files instead; both apply mutations through `objfmt::apply`). The disk crashes, loses unsynced
//! writes and tears them.
//!
//! Copy-on-write is deferred exactly as in the real store (see its module documentation): a
//! child's first write to an object of up to 64 KiB writes only the 4 KiB sectors it touches and
//! records, in unused bytes of its header sector ([`Base`]), which parent object holds the rest.
//! Reads merge; the block checksums cover the merged bytes, so boot checks a deferred copy like
//! any object. Before the parent's bytes change or go (a parent write, delete or rename) its
//! deferred children are completed durably; a child that grows past 64 KiB or is renamed is
//! completed first. So the simulator runs the same partial-copy paths as a real shard.
//!
//! A command is split in two: [`SimStore::start`] makes its changes (unsynced, as the page cache
//! would hold them) and [`SimStore::finish`] syncs them; a crash in between loses or tears them.

use sim::{DiskError, SimDisk};

use std::collections::BTreeMap;

use crate::store::objfmt::{self, ObjFile, HEADER_BYTES};
use crate::core::shard::{Boot, DiskCmd, DiskErr, DiskOut};
use crate::store::{claim_sectors, len_after, MemObject, CLASS_DATA_BYTES, LAZY_CLASS, LAZY_SECTOR_BYTES};
use crate::types::*;

/// Copies of objects up to this size are deferred (the real store's 64 KiB class).
const LAZY_MAX_BYTES: u64 = CLASS_DATA_BYTES[LAZY_CLASS];
/// Where the deferred-copy record sits in the header sector (objfmt uses bytes `0..280`).
const BASE_AT: usize = 384;
const BASE_BYTES: usize = 44;
const BASE_MAGIC: u32 = 0x4c41_5a31; // "LAZ1"
const _: () = assert!(BASE_AT + BASE_BYTES <= HEADER_BYTES as usize);

/// A deferred copy: sectors not in `present` read from `parent` (zeroes past `parent_len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Base {
    parent: ObjKey,
    parent_len: u64,
    /// Bit i: sector i is in the child's own file.
    present: u32,
}

impl Base {
    fn encode(base: Option<Base>, header: &mut [u8]) {
        let r = &mut header[BASE_AT..BASE_AT + BASE_BYTES];
        r.fill(0);
        let Some(b) = base else { return };
        r[0..4].copy_from_slice(&BASE_MAGIC.to_le_bytes());
        r[4..12].copy_from_slice(&b.parent.table.to_le_bytes());
        r[12..20].copy_from_slice(&b.parent.objno.to_le_bytes());
        r[20..28].copy_from_slice(&b.parent.owner.to_le_bytes());
        r[28..36].copy_from_slice(&b.parent_len.to_le_bytes());
        r[36..40].copy_from_slice(&b.present.to_le_bytes());
        let crc = crc32c::crc32c(&r[..40]);
        r[40..44].copy_from_slice(&crc.to_le_bytes());
    }

    fn decode(header: &[u8]) -> Option<Base> {
        let r = header.get(BASE_AT..BASE_AT + BASE_BYTES)?;
        let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap());
        let u32_at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().unwrap());
        if u32_at(0) != BASE_MAGIC || u32_at(40) != crc32c::crc32c(&r[..40]) {
            return None;
        }
        Some(Base {
            parent: ObjKey { table: u64_at(4), objno: u64_at(12), owner: u64_at(20) },
            parent_len: u64_at(28),
            present: u32_at(36),
        })
    }
}

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
    /// Deferred copies: child → its base (rebuilt from the headers at boot).
    lazy: BTreeMap<ObjKey, Base>,
    /// First child writes that made a deferred copy, and deferred copies completed (counts for
    /// tests: the partial-copy paths ran).
    pub deferred_copies_made: u64,
    pub deferred_copies_completed: u64,
}

impl SimStore {
    pub fn boot(&mut self) -> Boot {
        let mut boot = Boot::default();
        self.lazy.clear();
        for n in self.disk.list() {
            if let Some(key) = parse(&n) {
                let header = self.disk.read(&n, 0, HEADER_BYTES).unwrap_or_default();
                if let Some(base) = Base::decode(&header) {
                    self.lazy.insert(key, base);
                }
            }
        }
        for n in self.disk.list() {
            if let Some(key) = parse(&n) {
                let version = if self.lazy.contains_key(&key) {
                    self.merged(&key).and_then(|mut obj| objfmt::verify(&mut obj).map_err(ioe)).unwrap_or(objfmt::SUSPECT)
                } else {
                    objfmt::verify(&mut SimFile { disk: &mut self.disk, name: &n }).unwrap_or(objfmt::SUSPECT)
                };
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
        if !self.disk.exists(&n) {
            return None;
        }
        if self.lazy.contains_key(key) {
            return self.merged(key).ok().map(|o| o.body);
        }
        Some(self.read_body(&n))
    }

    /// Objects that are deferred copies right now (for tests: the partial-copy paths ran).
    pub fn deferred_copies(&self) -> usize {
        self.lazy.len()
    }

    /// An object's header and bytes, a deferred copy's merged with its parent's.
    fn merged(&mut self, key: &ObjKey) -> Result<MemObject, DiskErr> {
        let n = name(key);
        let header = self.disk.read(&n, 0, HEADER_BYTES).map_err(err)?;
        let mut objfmt_header = [0u8; HEADER_BYTES as usize];
        objfmt_header[..header.len()].copy_from_slice(&header);
        let len = self.disk.len(&n).map_err(err)?.saturating_sub(HEADER_BYTES);
        let mut body = self.disk.read(&n, HEADER_BYTES, len).map_err(err)?;
        body.resize(len as usize, 0);
        if let Some(b) = self.lazy.get(key).copied() {
            let pn = name(&b.parent);
            let parent = if self.disk.exists(&pn) { self.disk.read(&pn, HEADER_BYTES, b.parent_len).map_err(err)? } else { vec![] };
            for s in 0..len.div_ceil(LAZY_SECTOR_BYTES) {
                if b.present & (1 << s) != 0 {
                    continue;
                }
                let (a, e) = ((s * LAZY_SECTOR_BYTES) as usize, ((s + 1) * LAZY_SECTOR_BYTES).min(len) as usize);
                for (i, byte) in body[a..e].iter_mut().enumerate() {
                    *byte = parent.get(a + i).copied().unwrap_or(0);
                }
            }
        }
        Ok(MemObject { objfmt_header, body })
    }

    /// Makes a deferred copy whole, durably (its merged bytes, a header without a base).
    fn complete(&mut self, key: &ObjKey) -> Result<(), DiskErr> {
        if !self.lazy.contains_key(key) {
            return Ok(());
        }
        let mut obj = self.merged(key)?;
        let n = name(key);
        self.disk.write(&n, HEADER_BYTES, &obj.body).map_err(err)?;
        Base::encode(None, &mut obj.objfmt_header);
        self.disk.write(&n, 0, &obj.objfmt_header).map_err(err)?;
        self.disk.sync(&n).map_err(err)?;
        self.lazy.remove(key);
        self.deferred_copies_completed += 1;
        Ok(())
    }

    /// Completes every deferred copy that reads from `parent` (before its bytes change or go).
    fn complete_children_of(&mut self, parent: &ObjKey) -> Result<(), DiskErr> {
        let children: Vec<ObjKey> = self.lazy.iter().filter(|(_, b)| b.parent == *parent).map(|(k, _)| *k).collect();
        for c in children {
            self.complete(&c)?;
        }
        Ok(())
    }

    /// Applies a write or zeroing to a deferred copy held in `obj` (its merged bytes): writes
    /// only the sectors the operation touches and the header with the sectors now present.
    #[allow(clippy::too_many_arguments)]
    fn apply_lazy(&mut self, key: ObjKey, mut base: Base, mut obj: MemObject, version: Version, op: &RepOp, files: &mut Vec<String>) -> Result<DiskOut, DiskErr> {
        let old_len = obj.body.len() as u64;
        objfmt::apply(&mut obj, version, op).map_err(ioe)?;
        let new_len = obj.body.len() as u64;
        let (a, b, complete) = claim_sectors(&mut base.present, old_len, new_len, op);
        let base = (!complete).then_some(base);
        let n = name(&key);
        self.disk.truncate(&n, HEADER_BYTES + new_len).map_err(err)?;
        if b > a {
            self.disk.write(&n, HEADER_BYTES + a, &obj.body[a as usize..b as usize]).map_err(err)?;
        }
        Base::encode(base, &mut obj.objfmt_header);
        self.disk.write(&n, 0, &obj.objfmt_header).map_err(err)?;
        match base {
            Some(b) => self.lazy.insert(key, b),
            None => self.lazy.remove(&key),
        };
        files.push(n);
        Ok(DiskOut::Done)
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
            DiskCmd::Read { key, offset, len } if self.lazy.contains_key(&key) => {
                let body = self.merged(&key)?.body;
                let mut buf = vec![0u8; len as usize];
                let at = (offset as usize).min(body.len());
                let n = (len as usize).min(body.len() - at);
                buf[..n].copy_from_slice(&body[at..at + n]);
                Ok(DiskOut::Data(buf))
            }
            DiskCmd::ReadAll { key } if self.lazy.contains_key(&key) => Ok(DiskOut::Data(self.merged(&key)?.body)),
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
                let put = matches!(op, RepOp::Put { .. });
                // As the real store: an object that would outgrow the largest object size is
                // refused before anything is written (a write far past the end would otherwise
                // allocate the gap).
                let start_len = match (self.disk.exists(&n), cow_from) {
                    (true, _) => self.disk.len(&n).map_err(err)?,
                    (false, Some(src)) if self.disk.exists(&name(&src)) => self.disk.len(&name(&src)).map_err(err)?,
                    _ => HEADER_BYTES,
                }
                .saturating_sub(HEADER_BYTES);
                let len_bytes = len_after(start_len, &op);
                if len_bytes > MAX_OBJECT_SIZE_BYTES as u64 {
                    return Err(DiskErr::Io(format!("object {key:?} would be {len_bytes} bytes, larger than 4 MiB")));
                }
                if self.disk.exists(&n) {
                    // Children still reading this object's bytes get their own copy first.
                    self.complete_children_of(&key)?;
                    if let Some(base) = self.lazy.get(&key).copied() {
                        let len = self.disk.len(&n).map_err(err)?.saturating_sub(HEADER_BYTES);
                        if put {
                            // Replaces every byte: the header objfmt writes has no base.
                            self.lazy.remove(&key);
                        } else if len_after(len, &op) <= LAZY_MAX_BYTES {
                            let obj = self.merged(&key)?;
                            return self.apply_lazy(key, base, obj, version, &op, files);
                        } else {
                            self.complete(&key)?;
                        }
                    }
                }
                if let (Some(src), false) = (cow_from, self.disk.exists(&n)) {
                    let sn = name(&src);
                    let plen = self.disk.len(&sn).map_err(err)?.saturating_sub(HEADER_BYTES);
                    if !put && !self.lazy.contains_key(&src) && len_after(plen, &op) <= LAZY_MAX_BYTES {
                        // Deferred: the child's file gets only the sectors this write touches.
                        let header = self.disk.read(&sn, 0, HEADER_BYTES).map_err(err)?;
                        let mut objfmt_header = [0u8; HEADER_BYTES as usize];
                        objfmt_header[..header.len()].copy_from_slice(&header);
                        let mut body = self.disk.read(&sn, HEADER_BYTES, plen).map_err(err)?;
                        body.resize(plen as usize, 0);
                        self.disk.create(&n).map_err(err)?;
                        *dir = true;
                        let base = Base { parent: src, parent_len: plen, present: 0 };
                        self.deferred_copies_made += 1;
                        return self.apply_lazy(key, base, MemObject { objfmt_header, body }, version, &op, files);
                    }
                }
                if let Some(src) = cow_from {
                    if !self.disk.exists(&n) {
                        let sn = name(&src);
                        let bytes = if self.lazy.contains_key(&src) {
                            // The parent is itself a deferred copy: copy its merged bytes whole.
                            let mut p = self.merged(&src)?;
                            Base::encode(None, &mut p.objfmt_header);
                            [&p.objfmt_header[..], &p.body].concat()
                        } else {
                            let len = self.disk.len(&sn).map_err(err)?;
                            self.disk.read(&sn, 0, len).map_err(err)?
                        };
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
                    self.complete_children_of(&key)?;
                    self.disk.delete(&n).map_err(err)?;
                    self.lazy.remove(&key);
                    *dir = true;
                }
                Ok(DiskOut::Done)
            }
            DiskCmd::Rename { from, to } => {
                // Both objects' dependents keep their bytes, and the renamed object is whole.
                self.complete_children_of(&from)?;
                self.complete_children_of(&to)?;
                self.complete(&from)?;
                self.disk.rename(&name(&from), &name(&to)).map_err(err)?;
                self.lazy.remove(&to);
                *dir = true;
                Ok(DiskOut::Done)
            }
            // Simulated disks allocate nothing ahead: the hint changes nothing.
            DiskCmd::Prestock { .. } => Ok(DiskOut::Done),
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
