//! [`PeerCore`]: a log peer's state machine (sans-I/O): a bounded lent region holding the
//! replicated images of log files, one CRC32C per block.
//!
//! A peer is passive (SplitFT's "passive memory units"): it applies records in order, answers
//! probes and fetches, and does no work per byte beyond checking a record's checksum and keeping
//! the block checksums. Memory is accounted per file as the image size plus any staged image;
//! an op that would exceed the region is refused with `RegionFull`, never applied short.

use std::collections::BTreeMap;

use crate::proto::{Epoch, FileId, Holding, Op, PeerReply, PeerRequest, BLOCK_BYTES, MAX_CHUNK_BYTES, MAX_SUMS_BYTES, READ_EPOCH};

/// An input to a [`PeerCore`] ([`PeerCore::handle`]). A peer has no clock and no timer (it is
/// passive: it only answers), so time is no input and `handle` takes none.
#[derive(Debug)]
pub enum PeerInput {
    /// A client's request; answered with exactly one [`PeerReply`] in [`PeerCore::take_outputs`].
    Request(PeerRequest),
    /// Free everything held for the file (the controller placed it elsewhere or forgot it).
    Release(FileId),
    /// Shrink (or grow) the lent region. Shrinking below the bytes in use only refuses growth
    /// from now on; the driver shrinks to 0 once the controller moved every file away.
    SetRegionBytes(u64),
}

#[derive(Debug, Default)]
struct PeerFile {
    /// Highest epoch probed or written: anything below is refused (fencing).
    promised: Epoch,
    /// The committed copy: `None` until a Base was applied.
    committed: Option<Committed>,
    /// An image being staged for a `Base { from: None }` of this epoch.
    staging: Option<(Epoch, Vec<u8>)>,
}

#[derive(Debug)]
struct Committed {
    epoch: Epoch,
    seq: u64,
    image: Vec<u8>,
    block_crcs: Vec<u32>,
}

impl Committed {
    fn holding(&self) -> Holding {
        Holding { epoch: self.epoch, seq: self.seq, size: self.image.len() as u64 }
    }

    /// Recomputes the checksums of the blocks covering `start..end` (and drops or adds blocks so
    /// that there is exactly one per started block).
    fn refresh_crcs(&mut self, start: usize, end: usize) {
        let blocks = self.image.len().div_ceil(BLOCK_BYTES);
        self.block_crcs.resize(blocks, 0);
        let first = start / BLOCK_BYTES;
        let last = end.min(self.image.len()).div_ceil(BLOCK_BYTES);
        for b in first..last.min(blocks) {
            let lo = b * BLOCK_BYTES;
            let hi = (lo + BLOCK_BYTES).min(self.image.len());
            self.block_crcs[b] = crc32c::crc32c(&self.image[lo..hi]);
        }
    }

    /// Whether the existing blocks that `lo..hi` only partly covers still match their checksums.
    fn partial_blocks_intact(&self, lo: usize, hi: usize) -> bool {
        let len = self.image.len();
        let last = hi.max(lo + 1).saturating_sub(1) / BLOCK_BYTES;
        (lo / BLOCK_BYTES..=last).all(|b| {
            let start = b * BLOCK_BYTES;
            let end = (start + BLOCK_BYTES).min(len);
            start >= len || (lo <= start && hi >= end) || crc32c::crc32c(&self.image[start..end]) == self.block_crcs[b]
        })
    }

    fn from_image(epoch: Epoch, image: Vec<u8>) -> Committed {
        let mut c = Committed { epoch, seq: 1, image, block_crcs: Vec::new() };
        let len = c.image.len();
        c.refresh_crcs(0, len);
        c
    }
}

/// Largest log file a peer accepts (offsets and sizes beyond are refused, not allocated).
pub const MAX_FILE_BYTES: u64 = 1 << 40;

/// A log peer's state. Feed it requests with [`PeerCore::handle`]; it returns the reply.
#[derive(Debug)]
/// One log peer's lent region: inputs through [`PeerCore::handle`], replies from
/// [`PeerCore::take_outputs`], [`PeerCore::check_invariants`] after every input in debug builds.
pub struct PeerCore {
    region_bytes: u64,
    used_bytes: u64,
    files: BTreeMap<FileId, PeerFile>,
    /// Replies not yet taken by the driver (one per request).
    out: Vec<PeerReply>,
}

impl PeerCore {
    pub fn new(region_bytes: u64) -> PeerCore {
        PeerCore { region_bytes, used_bytes: 0, files: BTreeMap::new(), out: Vec::new() }
    }

    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Ids of the files the peer keeps any state for (reported in heartbeats).
    pub fn files(&self) -> Vec<FileId> {
        self.files.keys().copied().collect()
    }

    /// Frees everything held for `file`; returns the bytes freed.
    fn release(&mut self, file: FileId) -> u64 {
        match self.files.remove(&file) {
            Some(f) => {
                let b = f.bytes();
                self.used_bytes -= b;
                b
            }
            None => 0,
        }
    }

    /// Test hook: flips one byte of a file's committed image without fixing its checksum (a
    /// memory corruption); returns false if there is no byte to flip.
    pub fn corrupt(&mut self, file: FileId, at: u64) -> bool {
        match self.files.get_mut(&file).and_then(|f| f.committed.as_mut()) {
            Some(c) if !c.image.is_empty() => {
                let i = (at % c.image.len() as u64) as usize;
                c.image[i] ^= 0x5a;
                true
            }
            _ => false,
        }
    }

    /// What the peer holds of `file` (for tests and status).
    pub fn holding(&self, file: FileId) -> Option<Holding> {
        self.files.get(&file).and_then(|f| f.committed.as_ref()).map(|c| c.holding())
    }

    /// The committed copy of `file` a reader at `epoch` may read (Fetch and Sums), or the reply
    /// that refuses it. A [`READ_EPOCH`] reader is never stale (it checks the holding itself).
    fn committed_for_read(&self, file: FileId, epoch: Epoch) -> Result<&Committed, PeerReply> {
        let Some(f) = self.files.get(&file) else {
            return Err(PeerReply::NoCopy { file, epoch });
        };
        if epoch != READ_EPOCH && epoch < f.promised {
            return Err(PeerReply::Stale { file, promised: f.promised });
        }
        f.committed.as_ref().ok_or(PeerReply::NoCopy { file, epoch })
    }

    fn full(&self, file: FileId, epoch: Epoch) -> PeerReply {
        PeerReply::RegionFull { file, epoch, region_bytes: self.region_bytes, used_bytes: self.used_bytes }
    }

    /// Applies one input (a request's reply waits in [`PeerCore::take_outputs`]), then, in
    /// debug builds, [`PeerCore::check_invariants`].
    pub fn handle(&mut self, input: PeerInput) {
        match input {
            PeerInput::Request(req) => {
                let reply = self.handle_input(req);
                self.out.push(reply);
            }
            PeerInput::Release(file) => {
                self.release(file);
            }
            PeerInput::SetRegionBytes(region_bytes) => self.region_bytes = region_bytes,
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
    }

    /// The replies made since the last call, in request order.
    pub fn take_outputs(&mut self) -> Vec<PeerReply> {
        std::mem::take(&mut self.out)
    }

    /// `handle(PeerInput::Request(req))` and the one reply it made: what a server (or a
    /// simulation) does with each request it reads.
    pub fn reply_to(&mut self, req: PeerRequest) -> PeerReply {
        self.handle(PeerInput::Request(req));
        self.out.pop().expect("a request gets one reply")
    }

    /// Panics, naming the invariant and the state, if the peer's state breaks a rule the module
    /// doc states. O(files), never O(bytes held). Run after every request in debug builds and
    /// after every step of the simulations.
    pub fn check_invariants(&self) {
        let broken = |what: &str, state: String| -> ! { panic!("log peer: invariant `{what}` broken: {state}") };
        // Memory is accounted per file as the image size plus any staged image.
        let held: u64 = self.files.values().map(|f| f.bytes()).sum();
        if held != self.used_bytes {
            broken("used_bytes is the sum of the files' images and staged images", format!("used {} held {held}", self.used_bytes));
        }
        for (id, f) in &self.files {
            // Fencing: nothing is held at an epoch above the promise.
            if let Some(c) = &f.committed {
                if c.epoch > f.promised {
                    broken("a committed copy's epoch is at most the promised one", format!("file {id}: committed {:?} promised {}", c.holding(), f.promised));
                }
                // One CRC32C per started block.
                if c.block_crcs.len() != c.image.len().div_ceil(BLOCK_BYTES) {
                    broken("one checksum per block", format!("file {id}: {} bytes, {} checksums", c.image.len(), c.block_crcs.len()));
                }
                if c.seq == 0 || c.image.len() as u64 > MAX_FILE_BYTES {
                    broken("a committed copy has a Base (seq >= 1) and at most MAX_FILE_BYTES", format!("file {id}: {:?}", c.holding()));
                }
            }
            if let Some((e, img)) = &f.staging {
                if *e > f.promised || img.len() as u64 > MAX_FILE_BYTES {
                    broken("a staged image is for the promised epoch or older, within MAX_FILE_BYTES", format!("file {id}: staged at {e} ({} bytes), promised {}", img.len(), f.promised));
                }
            }
        }
    }

    /// One request's reply. Over 100 lines on purpose: one arm per request kind (records have
    /// their own [`PeerCore::record`]); each arm is the peer's whole answer to that request.
    fn handle_input(&mut self, req: PeerRequest) -> PeerReply {
        match req {
            PeerRequest::Stats => PeerReply::Stats {
                region_bytes: self.region_bytes,
                used_bytes: self.used_bytes,
                files: self.files.len() as u64,
            },
            PeerRequest::Probe { file, epoch: READ_EPOCH } => {
                // A reader: no promise, and no state kept for a file this peer does not hold.
                PeerReply::Probed { file, epoch: READ_EPOCH, holding: self.holding(file) }
            }
            PeerRequest::Probe { file, epoch } => {
                let f = self.files.entry(file).or_default();
                if epoch < f.promised {
                    return PeerReply::Stale { file, promised: f.promised };
                }
                self.used_bytes -= f.promise(epoch);
                PeerReply::Probed { file, epoch, holding: f.committed.as_ref().map(|c| c.holding()) }
            }
            PeerRequest::Fetch { file, epoch, offset, len } => {
                let c = match self.committed_for_read(file, epoch) {
                    Ok(c) => c,
                    Err(reply) => return reply,
                };
                if offset % BLOCK_BYTES as u64 != 0 || len as usize > MAX_CHUNK_BYTES || offset > c.image.len() as u64 {
                    return PeerReply::Refused { file, reason: format!("bad fetch {offset}+{len}") };
                }
                let lo = offset as usize;
                let hi = (lo + len as usize).min(c.image.len());
                let first = lo / BLOCK_BYTES;
                let last = hi.div_ceil(BLOCK_BYTES);
                PeerReply::Data {
                    file,
                    offset,
                    data: c.image[lo..hi].to_vec(),
                    block_crcs: c.block_crcs[first..last].to_vec(),
                    holding: c.holding(),
                }
            }
            PeerRequest::Sums { file, epoch, offset, len } => {
                let c = match self.committed_for_read(file, epoch) {
                    Ok(c) => c,
                    Err(reply) => return reply,
                };
                if offset % BLOCK_BYTES as u64 != 0 || len > MAX_SUMS_BYTES || offset > c.image.len() as u64 {
                    return PeerReply::Refused { file, reason: format!("bad sums request {offset}+{len}") };
                }
                let first = offset as usize / BLOCK_BYTES;
                let last = ((offset + len).min(c.image.len() as u64) as usize).div_ceil(BLOCK_BYTES);
                PeerReply::Sums { file, offset, block_crcs: c.block_crcs[first..last.max(first)].to_vec(), holding: c.holding() }
            }
            PeerRequest::Stage { file, epoch, seq, size, offset, data, supersede } => {
                let mut used = self.used_bytes;
                let region = self.region_bytes;
                let f = self.files.entry(file).or_default();
                if epoch < f.promised {
                    return PeerReply::Stale { file, promised: f.promised };
                }
                f.promised = epoch;
                if f.committed.as_ref().is_some_and(|c| (c.epoch, c.seq) >= (epoch, seq)) {
                    // A late duplicate: the Base it was for is applied (it must not pin a second
                    // image, let alone release the copy).
                    return PeerReply::Staged { file, epoch, offset };
                }
                let end = offset.checked_add(data.len() as u64);
                if end.is_none_or(|e| e > size) || size > MAX_FILE_BYTES {
                    return PeerReply::Refused { file, reason: "stage chunk beyond the image size".into() };
                }
                let old = match &f.staging {
                    Some((e, img)) if *e == epoch && img.len() as u64 == size => None,
                    Some((_, img)) => Some(img.len() as u64),
                    None => Some(0),
                };
                if let Some(old) = old {
                    let mine = f.committed.as_ref().map_or(0, |c| c.image.len() as u64);
                    if used - old + size > region && supersede && used - old - mine + size <= region {
                        // No room beside the old copy, and the client says a majority holds
                        // every acknowledged op without it: release it and stage in its place
                        // (until the Base commits this peer is no witness, like a restarted one).
                        f.committed = None;
                        used -= mine;
                    }
                    if used - old + size > region {
                        return PeerReply::RegionFull { file, epoch, region_bytes: region, used_bytes: used };
                    }
                    f.staging = Some((epoch, vec![0; size as usize]));
                    self.used_bytes = used - old + size;
                }
                let img = &mut self.files.get_mut(&file).unwrap().staging.as_mut().unwrap().1;
                img[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
                PeerReply::Staged { file, epoch, offset }
            }
            PeerRequest::StageCopy { file, epoch, seq, size } => {
                if size > MAX_FILE_BYTES {
                    return PeerReply::Refused { file, reason: format!("size beyond {MAX_FILE_BYTES} bytes") };
                }
                let region = self.region_bytes;
                let used = self.used_bytes;
                let f = self.files.entry(file).or_default();
                if epoch < f.promised {
                    return PeerReply::Stale { file, promised: f.promised };
                }
                f.promised = epoch;
                let Some(c) = &f.committed else { return PeerReply::NoCopy { file, epoch } };
                if (c.epoch, c.seq) >= (epoch, seq) {
                    return PeerReply::Staged { file, epoch, offset: 0 }; // a late duplicate
                }
                // Never releases the copy (it is the patch's base): no room beside it is refused.
                let old = f.staging.as_ref().map_or(0, |(_, i)| i.len() as u64);
                if used - old + size > region {
                    return PeerReply::RegionFull { file, epoch, region_bytes: region, used_bytes: used };
                }
                let keep = c.image.len().min(size as usize);
                let mut img = Vec::with_capacity(size as usize);
                img.extend_from_slice(&c.image[..keep]);
                img.resize(size as usize, 0);
                f.staging = Some((epoch, img));
                self.used_bytes = used - old + size;
                PeerReply::Staged { file, epoch, offset: 0 }
            }
            PeerRequest::Drop { file, epoch } => {
                if let Some(f) = self.files.get(&file) {
                    if epoch < f.promised {
                        return PeerReply::Stale { file, promised: f.promised };
                    }
                    let f = self.files.remove(&file).unwrap();
                    self.used_bytes -= f.bytes();
                }
                PeerReply::Dropped { file }
            }
            PeerRequest::Record { file, epoch, seq, op } => self.record(file, epoch, seq, op),
        }
    }

    /// Applies one record. Over 100 lines on purpose: the checks (checksum, fencing, order,
    /// room) and the apply of each op kind (Base from a copy or a staged image, Write,
    /// Truncate) read as one sequence whose order is the safety argument (nothing is applied
    /// short, nothing at a fenced epoch).
    fn record(&mut self, file: FileId, epoch: Epoch, seq: u64, op: Op) -> PeerReply {
        if let Op::Write { data, crc, offset } = &op {
            if crc32c::crc32c(data) != *crc {
                return PeerReply::Refused { file, reason: "record checksum mismatch".into() };
            }
            if offset.checked_add(data.len() as u64).is_none_or(|end| end > MAX_FILE_BYTES) {
                return PeerReply::Refused { file, reason: format!("write beyond {MAX_FILE_BYTES} bytes") };
            }
        }
        if let Op::Truncate { size } | Op::Base { size, .. } = &op {
            if *size > MAX_FILE_BYTES {
                return PeerReply::Refused { file, reason: format!("size beyond {MAX_FILE_BYTES} bytes") };
            }
        }
        let f = self.files.entry(file).or_default();
        if epoch < f.promised {
            return PeerReply::Stale { file, promised: f.promised };
        }
        self.used_bytes -= f.promise(epoch);
        let f = self.files.get_mut(&file).unwrap();
        let ack = |c: &Option<Committed>| match c {
            Some(c) => PeerReply::Ack { file, epoch: c.epoch, applied_seq: c.seq },
            None => PeerReply::Ack { file, epoch: 0, applied_seq: 0 },
        };
        let in_epoch = f.committed.as_ref().is_some_and(|c| c.epoch == epoch);
        // A Base starts an epoch (seq 1), or re-bases a peer that lost its copy mid-epoch (any
        // seq, full image only, never backwards).
        let rebase = matches!(op, Op::Base { from: None, .. }) && f.committed.as_ref().is_none_or(|c| c.epoch != epoch || c.seq < seq);
        if !in_epoch || rebase {
            // Anything but a Base waits for a retransmit.
            let Op::Base { from, size, image_crc } = op else { return ack(&f.committed) };
            if from.is_some() && seq != 1 {
                return ack(&f.committed);
            }
            match from {
                Some(from) => match f.committed.as_mut() {
                    Some(c) if (c.epoch, c.seq) == from && c.image.len() as u64 == size => {
                        c.epoch = epoch;
                        c.seq = 1;
                    }
                    _ => return PeerReply::NeedImage { file, epoch },
                },
                None => {
                    let image = if size == 0 && image_crc == crc32c::crc32c(&[]) {
                        Vec::new()
                    } else {
                        match f.staging.take() {
                            Some((e, img)) if e == epoch && img.len() as u64 == size && crc32c::crc32c(&img) == image_crc => img,
                            other => {
                                f.staging = other;
                                return PeerReply::NeedImage { file, epoch };
                            }
                        }
                    };
                    // Staged bytes were counted when staged; a leftover staging and the old copy
                    // are released.
                    let leftover = f.staging.take().map(|(_, i)| i.len() as u64).unwrap_or(0);
                    let old = f.committed.take().map(|c| c.image.len() as u64).unwrap_or(0);
                    let mut c = Committed::from_image(epoch, image);
                    c.seq = seq;
                    f.committed = Some(c);
                    self.used_bytes -= old + leftover;
                }
            }
            let f = self.files.get_mut(&file).unwrap();
            return ack(&f.committed);
        }
        let c = f.committed.as_mut().unwrap();
        if seq != c.seq + 1 {
            // A duplicate (already applied) or a gap (an earlier record was lost): the cumulative
            // ack tells the client where to resume.
            return ack(&f.committed);
        }
        let cur = c.image.len() as u64;
        let new_len = match &op {
            Op::Write { offset, data, .. } => cur.max(offset + data.len() as u64),
            Op::Truncate { size } => *size,
            Op::Base { .. } => return PeerReply::Refused { file, reason: "Base inside an epoch".into() },
        };
        if new_len > cur && self.used_bytes + (new_len - cur) > self.region_bytes {
            return self.full(file, epoch);
        }
        let f = self.files.get_mut(&file).unwrap();
        let c = f.committed.as_mut().unwrap();
        // A block that is only partly rewritten keeps bytes we did not receive now: check them
        // first, or a corruption at rest would be sealed under a fresh checksum. Appends extend
        // the last block's checksum instead (no re-read).
        let (lo, hi) = match &op {
            Op::Write { offset, data, .. } => (*offset as usize, *offset as usize + data.len()),
            Op::Truncate { size } => (*size as usize, *size as usize),
            Op::Base { .. } => unreachable!(),
        };
        let append = matches!(op, Op::Write { .. }) && lo == cur as usize;
        if !append && !c.partial_blocks_intact(lo.min(cur as usize), hi) {
            // This copy is corrupt: drop it (no longer a witness); the client re-bases us.
            let old = f.committed.take().map(|c| c.image.len() as u64).unwrap_or(0);
            self.used_bytes -= old;
            return PeerReply::Ack { file, epoch: 0, applied_seq: 0 };
        }
        match op {
            Op::Write { data, .. } if append => {
                let tail = cur as usize % BLOCK_BYTES;
                let head = if tail == 0 { 0 } else { (BLOCK_BYTES - tail).min(data.len()) };
                c.image.extend_from_slice(&data);
                if head > 0 {
                    let last = c.block_crcs.len() - 1;
                    c.block_crcs[last] = crc32c::crc32c_append(c.block_crcs[last], &data[..head]);
                }
                // Blocks after the extended one (if the append reaches them) get fresh checksums.
                let next_block = if head > 0 { (cur as usize / BLOCK_BYTES + 1) * BLOCK_BYTES } else { cur as usize };
                c.refresh_crcs(next_block, hi);
            }
            Op::Write { data, .. } => {
                if c.image.len() < hi {
                    c.image.resize(hi, 0);
                }
                c.image[lo..hi].copy_from_slice(&data);
                // Blocks from the old end are included: a gap before `offset` was zero-filled.
                c.refresh_crcs(lo.min(cur as usize), hi);
            }
            Op::Truncate { size } => {
                c.image.truncate(size as usize);
                c.image.resize(size as usize, 0);
                c.refresh_crcs((size as usize).min(cur as usize), size as usize);
            }
            Op::Base { .. } => unreachable!(),
        }
        c.seq += 1;
        self.used_bytes = self.used_bytes + new_len - cur;
        let f = self.files.get(&file).unwrap();
        ack(&f.committed)
    }
}

impl PeerFile {
    /// Promises `epoch`; an image staged for an older epoch can never be committed any more
    /// and is freed (a client that crashed mid-stage must not pin region bytes). Returns the
    /// bytes freed.
    fn promise(&mut self, epoch: Epoch) -> u64 {
        self.promised = self.promised.max(epoch);
        match &self.staging {
            Some((e, img)) if *e < epoch => {
                let n = img.len() as u64;
                self.staging = None;
                n
            }
            _ => 0,
        }
    }

    fn bytes(&self) -> u64 {
        self.committed.as_ref().map(|c| c.image.len() as u64).unwrap_or(0)
            + self.staging.as_ref().map(|(_, i)| i.len() as u64).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base_empty(p: &mut PeerCore, file: FileId, epoch: Epoch) {
        let r = p.reply_to(PeerRequest::Record { file, epoch, seq: 1, op: Op::Base { from: None, size: 0, image_crc: crc32c::crc32c(&[]) } });
        assert_eq!(r, PeerReply::Ack { file, epoch, applied_seq: 1 });
    }

    #[test]
    fn applies_in_order_and_acks_cumulatively() {
        let mut p = PeerCore::new(1 << 20);
        base_empty(&mut p, 1, 1);
        let w = |seq, off, d: &[u8]| PeerRequest::Record { file: 1, epoch: 1, seq, op: Op::write(off, d.to_vec()) };
        assert_eq!(p.reply_to(w(3, 5, b"zz")), PeerReply::Ack { file: 1, epoch: 1, applied_seq: 1 }, "gap waits");
        assert_eq!(p.reply_to(w(2, 0, b"hello")), PeerReply::Ack { file: 1, epoch: 1, applied_seq: 2 });
        assert_eq!(p.reply_to(w(2, 0, b"hello")), PeerReply::Ack { file: 1, epoch: 1, applied_seq: 2 }, "dup");
        assert_eq!(p.reply_to(w(3, 5, b"zz")), PeerReply::Ack { file: 1, epoch: 1, applied_seq: 3 });
        assert_eq!(p.used_bytes(), 7);
        let tr = PeerRequest::Record { file: 1, epoch: 1, seq: 4, op: Op::Truncate { size: 10 } };
        p.reply_to(tr);
        match p.reply_to(PeerRequest::Fetch { file: 1, epoch: 1, offset: 0, len: 100 }) {
            PeerReply::Data { data, block_crcs, .. } => {
                assert_eq!(data, b"hellozz\0\0\0");
                assert_eq!(block_crcs, vec![crc32c::crc32c(&data)]);
            }
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn full_region_refuses_and_applies_nothing() {
        let mut p = PeerCore::new(8);
        base_empty(&mut p, 1, 1);
        let r = p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 2, op: Op::write(0, vec![1; 9]) });
        assert!(matches!(r, PeerReply::RegionFull { .. }), "{r:?}");
        assert_eq!(p.holding(1).unwrap().size, 0);
        assert_eq!(p.used_bytes(), 0);
    }

    #[test]
    fn newer_epoch_fences_older_writer_and_drop_frees() {
        let mut p = PeerCore::new(1 << 20);
        base_empty(&mut p, 1, 1);
        p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 2, op: Op::write(0, vec![7; 100]) });
        assert!(matches!(p.reply_to(PeerRequest::Probe { file: 1, epoch: 2 }), PeerReply::Probed { holding: Some(Holding { epoch: 1, seq: 2, size: 100 }), .. }));
        let r = p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 3, op: Op::write(0, vec![1]) });
        assert_eq!(r, PeerReply::Stale { file: 1, promised: 2 });
        let adopt = Op::Base { from: Some((1, 2)), size: 100, image_crc: 0 };
        assert_eq!(p.reply_to(PeerRequest::Record { file: 1, epoch: 2, seq: 1, op: adopt }), PeerReply::Ack { file: 1, epoch: 2, applied_seq: 1 });
        assert_eq!(p.reply_to(PeerRequest::Drop { file: 1, epoch: 2 }), PeerReply::Dropped { file: 1 });
        assert_eq!(p.used_bytes(), 0);
    }

    #[test]
    fn stage_copy_starts_from_the_committed_copy_and_a_peer_without_one_says_so() {
        let mut p = PeerCore::new(1 << 20);
        assert_eq!(p.reply_to(PeerRequest::StageCopy { file: 1, epoch: 1, seq: 1, size: 10 }), PeerReply::NoCopy { file: 1, epoch: 1 });
        assert_eq!(p.reply_to(PeerRequest::Sums { file: 1, epoch: 1, offset: 0, len: 10 }), PeerReply::NoCopy { file: 1, epoch: 1 });
        base_empty(&mut p, 1, 1);
        p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 2, op: Op::write(0, b"abcdef".to_vec()) });
        // Epoch 2's image: "abXdef" + "gh"; the patch sends only what differs.
        let want = b"abXdefgh".to_vec();
        assert_eq!(p.reply_to(PeerRequest::StageCopy { file: 1, epoch: 2, seq: 1, size: 8 }), PeerReply::Staged { file: 1, epoch: 2, offset: 0 });
        assert_eq!(p.used_bytes(), 6 + 8, "the staged image is counted beside the copy");
        for (offset, data) in [(2u64, b"X".to_vec()), (6, b"gh".to_vec())] {
            let r = p.reply_to(PeerRequest::Stage { file: 1, epoch: 2, seq: 1, size: 8, offset, data, supersede: false });
            assert!(matches!(r, PeerReply::Staged { .. }), "{r:?}");
        }
        let base = Op::Base { from: None, size: 8, image_crc: crc32c::crc32c(&want) };
        assert_eq!(p.reply_to(PeerRequest::Record { file: 1, epoch: 2, seq: 1, op: base }), PeerReply::Ack { file: 1, epoch: 2, applied_seq: 1 });
        assert_eq!(p.used_bytes(), 8);
        match p.reply_to(PeerRequest::Fetch { file: 1, epoch: 2, offset: 0, len: 100 }) {
            PeerReply::Data { data, .. } => assert_eq!(data, want),
            r => panic!("{r:?}"),
        }
        // No room beside the copy: refused (a patch never releases its base).
        let mut small = PeerCore::new(10);
        base_empty(&mut small, 1, 1);
        small.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 2, op: Op::write(0, vec![1; 6]) });
        assert!(matches!(small.reply_to(PeerRequest::StageCopy { file: 1, epoch: 2, seq: 1, size: 6 }), PeerReply::RegionFull { .. }));
        assert_eq!(small.holding(1).map(|h| h.size), Some(6));
    }

    #[test]
    fn bad_record_checksum_is_refused() {
        let mut p = PeerCore::new(1 << 20);
        base_empty(&mut p, 1, 1);
        let op = Op::Write { offset: 0, data: vec![1, 2, 3], crc: 0 };
        assert!(matches!(p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 2, op }), PeerReply::Refused { .. }));
    }
}

#[cfg(test)]
mod corruption_tests {
    use super::*;

    #[test]
    fn corruption_at_rest_is_never_sealed_by_later_ops() {
        let mut p = PeerCore::new(1 << 20);
        let r = p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq: 1, op: Op::Base { from: None, size: 0, image_crc: crc32c::crc32c(&[]) } });
        assert!(matches!(r, PeerReply::Ack { applied_seq: 1, .. }));
        let mut seq = 1;
        let mut w = |p: &mut PeerCore, op: Op| {
            seq += 1;
            p.reply_to(PeerRequest::Record { file: 1, epoch: 1, seq, op })
        };
        w(&mut p, Op::write(0, vec![1; 6094]));
        assert!(p.corrupt(1, 4867));
        for size in [8024usize, 9084, 24692] {
            let cur = p.holding(1).unwrap().size as usize;
            w(&mut p, Op::write(cur as u64, vec![2; size - cur]));
        }
        let r = w(&mut p, Op::Truncate { size: 6750 });
        assert_eq!(r, PeerReply::Ack { file: 1, epoch: 0, applied_seq: 0 }, "corrupt copy dropped");
        assert_eq!(p.holding(1), None);
    }

    /// The invariant checks can fail: a peer whose accounting is off panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut p = PeerCore::new(1 << 20);
        p.check_invariants();
        p.used_bytes = 10; // accounted, yet nothing held
        let e = std::panic::catch_unwind(|| p.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(msg.contains("used_bytes is the sum"), "{msg}");
    }
}
