//! Deferred copy-on-write: a `super` child's first write to an object of the 64 KiB class writes
//! only the sectors it touches; reads merge with the parent's slot; a copy is completed before its
//! parent's bytes change or go (see [`Base`]).

use super::*;

impl<D: StoreFs> Inner<D> {
    /// Applies a write or zeroing to a deferred copy (`obj` holds its merged bytes; `slot` is the
    /// child's own slot, fresh or its current one): writes only the sectors the operation
    /// touches, then the header with the sectors now present, one fdatasync. Once every sector
    /// is present the copy is complete and the header drops the base.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_lazy(&self, key: ObjKey, slot: SlotRef, mut base: Base, obj: LazySource, version: Version, op: &RepOp, fresh: bool) -> io::Result<()> {
        // The bytes the sectors to write start from, from `from` bytes into the object.
        let (old_len, new_len, objfmt_header, from, bytes) = match obj {
            LazySource::Whole(mut obj) => {
                let old_len = obj.body.len() as u64;
                objfmt::apply(&mut obj, version, op)?;
                (old_len, obj.body.len() as u64, obj.objfmt_header, 0, obj.body)
            }
            LazySource::Window(mut w) => {
                objfmt::apply(&mut w, version, op)?;
                (w.len_bytes, w.len_bytes, w.objfmt_header, w.start, w.bytes)
            }
        };
        let (a, b, complete) = claim_sectors(&mut base.present, old_len, new_len, op);
        let base = (!complete).then_some(base);
        let t = std::time::Instant::now();
        let written = (|| {
            let w = self.writer(&slot)?;
            if b > a {
                let range = a.checked_sub(from).zip(b.checked_sub(from)).filter(|(_, e)| *e as usize <= bytes.len());
                let Some((x, y)) = range else { return Err(io::Error::other("deferred copy: sectors outside the bytes read")) };
                w.write_all_at(&bytes[x as usize..y as usize], SLOT_HEADER_PAGE_BYTES + a)?;
            }
            let object = LiveObject { key, len_bytes: new_len, objfmt_header, base };
            self.commit_header(&w, slot, Some(object))
        })();
        if fresh {
            add_us(&self.counters.cow_commit_us, t);
        }
        match written {
            Ok(slot) => {
                if fresh {
                    inc(&self.counters.deferred_copies_made);
                }
                self.index.lock().unwrap().insert(key, Entry { slot, len_bytes: new_len, base });
                Ok(())
            }
            Err(e) => {
                if fresh {
                    self.give_back(slot);
                }
                Err(e)
            }
        }
    }

    /// What a write to a deferred copy (new or not) starts from. A write inside the object's
    /// bytes and one checksum block ([`objfmt::small_write_fits`]) needs only the whole sectors
    /// it touches and the header: the checksum is updated from the bytes it replaces. Before,
    /// every child first write read and checksummed the whole 64 KiB parent object. Any other
    /// write gets the whole object.
    pub(super) fn lazy_source(&self, key: &ObjKey, e: &Entry, op: &RepOp) -> io::Result<LazySource> {
        if let RepOp::Write { offset, data } = op {
            let f = self.open_slot(&e.slot)?;
            let live = self.read_live(&f, key, e)?;
            let (offset, len) = (*offset as u64, data.len() as u64);
            if objfmt::Header::decode(&live.objfmt_header).is_some_and(|h| objfmt::small_write_fits(&h, e.len_bytes, offset, len)) {
                let start = offset / LAZY_SECTOR_BYTES * LAZY_SECTOR_BYTES;
                let stop = ((offset + len).div_ceil(LAZY_SECTOR_BYTES) * LAZY_SECTOR_BYTES).min(e.len_bytes);
                let mut bytes = vec![0u8; (stop - start) as usize];
                self.read_body_at(&f, e, &mut bytes, start)?;
                return Ok(LazySource::Window(Window { objfmt_header: live.objfmt_header, len_bytes: e.len_bytes, start, bytes }));
            }
        }
        Ok(LazySource::Whole(self.load(key, e)?))
    }

    /// Makes a deferred copy whole: writes its merged bytes into its slot and a header without
    /// a base, durably. Nothing to do for any other object.
    ///
    /// The bytes are made durable before the header (two `fdatasync`s, or two journal records):
    /// the copy holds acknowledged writes, so a crash in between must leave it readable — the
    /// old header (with the base) over bytes that read the same either way. With one sync for
    /// both, a crash could keep the new header over torn bytes, and the child's acknowledged
    /// writes would be suspect (found by the power-cut test of every command on the simulated
    /// disk).
    pub(super) fn complete(&self, key: ObjKey) -> io::Result<()> {
        let Some(e) = self.entry(&key) else { return Ok(()) };
        if e.base.is_none() {
            return Ok(());
        }
        let obj = self.load(&key, &e)?;
        let w = self.writer(&e.slot)?;
        w.write_all_at(&obj.body, SLOT_HEADER_PAGE_BYTES)?;
        self.make_durable(&w)?;
        let object = LiveObject { key, len_bytes: e.len_bytes, objfmt_header: obj.objfmt_header, base: None };
        let slot = self.commit_header(&w, e.slot, Some(object))?;
        self.index.lock().unwrap().insert(key, Entry { slot, len_bytes: e.len_bytes, base: None });
        inc(&self.counters.deferred_copies_completed);
        Ok(())
    }

    /// Completes every deferred copy of `parent`, before its bytes change or go.
    pub(super) fn complete_children_of(&self, parent: &ObjKey) -> io::Result<()> {
        let children = self.index.lock().unwrap().lazy_children.get(parent).cloned().unwrap_or_default();
        for child in children {
            self.complete(child)?;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes of an object's body from `offset` (inside its length). A deferred
    /// copy takes the sectors it does not hold from its parent's slot — or zeroes, should that
    /// slot no longer hold the parent (which the invariant of [`Base`] rules out; the block
    /// checksums would then mark the object suspect at boot).
    pub(super) fn read_body_at(&self, f: &D::File, e: &Entry, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some(base) = e.base else {
            let got = read_full_at(f, buf, SLOT_HEADER_PAGE_BYTES + offset)?;
            buf[got..].fill(0);
            return Ok(());
        };
        let parent = {
            let idx = self.index.lock().unwrap();
            idx.objects.get(&base.key).is_some_and(|p| p.slot.class == base.class && p.slot.no == base.no)
        };
        let parent = if parent { Some(self.open_slot(&SlotRef { class: base.class, no: base.no, current_copy: 0 })?) } else { None };
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            // A run of sectors from one source.
            let sector = at / LAZY_SECTOR_BYTES;
            let here = base.present & (1 << sector) != 0;
            let mut run_end = ((sector + 1) * LAZY_SECTOR_BYTES).min(end);
            while run_end < end && (base.present & (1 << (run_end / LAZY_SECTOR_BYTES)) != 0) == here {
                run_end = ((run_end / LAZY_SECTOR_BYTES + 1) * LAZY_SECTOR_BYTES).min(end);
            }
            let out = &mut buf[(at - offset) as usize..(run_end - offset) as usize];
            let (src, valid) = if here { (Some(f), out.len()) } else { (parent.as_ref(), base.len_bytes.saturating_sub(at).min(out.len() as u64) as usize) };
            let got = match src {
                Some(src) => read_full_at(src, &mut out[..valid], SLOT_HEADER_PAGE_BYTES + at)?,
                None => 0,
            };
            out[got..].fill(0);
            at = run_end;
        }
        Ok(())
    }
}
