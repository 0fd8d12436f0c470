//! The commands that change objects: writes in place, moves to a bigger class, fresh slots,
//! deletes and renames (each a header write).

use super::*;

impl<D: StoreFs> Inner<D> {
    pub(super) fn apply(&self, key: ObjKey, version: Version, op: RepOp, cow_from: Option<ObjKey>) -> io::Result<()> {
        let existing = self.entry(&key);
        // A new child starts as a copy of its parent: its length after `op` counts from the parent's.
        let start_len = match (existing, cow_from) {
            (Some(e), _) => e.len_bytes,
            (None, Some(src)) => self.entry(&src).map_or(0, |p| p.len_bytes),
            (None, None) => 0,
        };
        let len_bytes = len_after(start_len, &op);
        if len_bytes > MAX_OBJECT_SIZE_BYTES as u64 {
            return Err(invalid(format!("object {key:?} would be {len_bytes} bytes, larger than 4 MiB")));
        }
        if existing.is_some() {
            // Children still reading this object's bytes get their own copy first.
            self.complete_children_of(&key)?;
        }
        let lazy_fits = len_bytes <= CLASS_DATA_BYTES[LAZY_CLASS] && !matches!(op, RepOp::Put { .. });
        match existing {
            Some(e) if e.base.is_some() && lazy_fits && e.slot.class == LAZY_CLASS => {
                let obj = self.lazy_source(&key, &e, &op)?;
                self.apply_lazy(key, e.slot, e.base.unwrap(), obj, version, &op, false)
            }
            Some(e) if e.base.is_some() && !matches!(op, RepOp::Put { .. }) => {
                // Grows past the deferred-copy class: complete the copy, then as any object.
                self.complete(key)?;
                self.apply(key, version, op, None)
            }
            // A Put replaces every byte: the deferred copy simply ends (apply_in_place writes a
            // header without a base).
            Some(e) if len_bytes <= CLASS_DATA_BYTES[e.slot.class] => self.apply_in_place(key, e, version, &op),
            Some(e) => {
                // Outgrows its class: build it in memory, make it durable in a bigger slot, and
                // only then free the old slot (a crash in between leaves two claims; open keeps
                // the newer).
                let mut obj = self.load(&key, &e)?;
                objfmt::apply(&mut obj, version, &op)?;
                self.write_fresh(key, obj)?;
                // If freeing fails the write is durable but reported failed (the client
                // retries; the replay is an overwrite). The old slot is then out of use until
                // the next open, whose duplicate rule frees it: it must not be reused before,
                // or a later delete of the key could let its stale claim come back.
                self.free_slot(e.slot)
            }
            None if cow_from.is_some() && lazy_fits => {
                inc(&self.counters.cow_first_writes);
                let src = cow_from.unwrap();
                let pe = self.entry(&src).ok_or_else(|| not_found(&src))?;
                let t = std::time::Instant::now();
                if pe.base.is_some() {
                    // The parent is itself a deferred copy (a child promoted moments ago, not yet
                    // garbage collected): copy it whole rather than chain deferred copies.
                    let mut obj = self.load(&src, &pe)?;
                    add_us(&self.counters.cow_load_us, t);
                    objfmt::apply(&mut obj, version, &op)?;
                    return self.write_fresh_as(key, obj, true);
                }
                let obj = self.lazy_source(&src, &pe, &op)?;
                add_us(&self.counters.cow_load_us, t);
                let slot = self.take_slot(LAZY_CLASS, true)?;
                let base = Base { key: src, class: pe.slot.class, no: pe.slot.no, len_bytes: pe.len_bytes, present: 0 };
                self.apply_lazy(key, slot, base, obj, version, &op, true)
            }
            None => {
                let mut obj = match cow_from {
                    // Collocated copy-on-write: a local copy, no network transfer (§4.2.1).
                    Some(src) => {
                        inc(&self.counters.cow_first_writes);
                        let pe = self.entry(&src).ok_or_else(|| not_found(&src))?;
                        self.load(&src, &pe)?
                    }
                    None => MemObject { objfmt_header: [0; HEADER_COPY_BYTES], body: vec![] },
                };
                objfmt::apply(&mut obj, version, &op)?;
                self.write_fresh_as(key, obj, cow_from.is_some())
            }
        }
    }

    /// Gives a fresh slot that got no object back to the pool, with a free header over whatever
    /// got written. If even that fails, the slot stays out of use until the next open sorts it
    /// out.
    pub(super) fn give_back(&self, slot: SlotRef) {
        if let Ok(w) = self.writer(&slot) {
            if let Ok(slot) = self.commit_header(&w, slot, None) {
                self.index.lock().unwrap().put_free(slot);
            }
        }
    }

    /// An overwrite: the data goes where it is, the header to the other copy, one fdatasync.
    pub(super) fn apply_in_place(&self, key: ObjKey, e: Entry, version: Version, op: &RepOp) -> io::Result<()> {
        let t = std::time::Instant::now();
        inc(&self.counters.in_place_writes);
        let w = self.writer(&e.slot)?;
        let live = self.read_live(&w.f, &key, &e)?;
        let mut obj = SlotObject {
            file: &w,
            objfmt_header: live.objfmt_header,
            len_bytes: e.len_bytes,
            capacity_bytes: CLASS_DATA_BYTES[e.slot.class],
        };
        objfmt::apply(&mut obj, version, op)?;
        let len_bytes = obj.len_bytes;
        let object = LiveObject { key, len_bytes, objfmt_header: obj.objfmt_header, base: None };
        let slot = self.commit_header(&w, e.slot, Some(object))?;
        self.index.lock().unwrap().insert(key, Entry { slot, len_bytes, base: None });
        add_us(&self.counters.in_place_us, t);
        Ok(())
    }

    /// An object's header and bytes, in memory.
    pub(super) fn load(&self, key: &ObjKey, e: &Entry) -> io::Result<MemObject> {
        let f = self.open_slot(&e.slot)?;
        let live = self.read_live(&f, key, e)?;
        let body = if e.base.is_some() {
            let mut body = vec![0u8; e.len_bytes as usize];
            self.read_body_at(&f, e, &mut body, 0)?;
            body
        } else {
            // Read into uninitialised capacity ([`SlotFile::read_vec`]).
            let mut body = f.read_vec(SLOT_HEADER_PAGE_BYTES, e.len_bytes)?;
            body.resize(e.len_bytes as usize, 0); // a short slot file: missing bytes read as zeroes
            body
        };
        Ok(MemObject { objfmt_header: live.objfmt_header, body })
    }

    /// Writes an object built in memory into a free slot (the smallest class it fits) and enters
    /// it in the index, replacing any entry of its key (whose slot the caller then frees).
    pub(super) fn write_fresh(&self, key: ObjKey, obj: MemObject) -> io::Result<()> {
        self.write_fresh_as(key, obj, false)
    }

    /// [`Inner::write_fresh`]; `child_first_write` as for [`Inner::take_slot`].
    pub(super) fn write_fresh_as(&self, key: ObjKey, obj: MemObject, child_first_write: bool) -> io::Result<()> {
        let len_bytes = obj.body.len() as u64;
        let class = class_for(len_bytes).ok_or_else(|| invalid(format!("object {key:?} larger than 4 MiB")))?;
        let slot = self.take_slot(class, child_first_write)?;
        let written = (|| {
            let w = self.writer(&slot)?;
            w.write_all_at(&obj.body, SLOT_HEADER_PAGE_BYTES)?;
            let object = LiveObject { key, len_bytes, objfmt_header: obj.objfmt_header, base: None };
            self.commit_header(&w, slot, Some(object))
        })();
        match written {
            Ok(slot) => {
                self.index.lock().unwrap().insert(key, Entry { slot, len_bytes, base: None });
                Ok(())
            }
            Err(e) => {
                self.give_back(slot);
                Err(e)
            }
        }
    }

    /// Writes a free header into a slot (durably) and puts it on its free list.
    pub(super) fn free_slot(&self, slot: SlotRef) -> io::Result<()> {
        let w = self.writer(&slot)?;
        let slot = self.commit_header(&w, slot, None)?;
        let mut idx = self.index.lock().unwrap();
        idx.put_free(slot);
        let over = idx.free[slot.class].len() > self.pool.free_slots_max[slot.class];
        drop(idx);
        if over {
            self.wake_refill();
        }
        Ok(())
    }

    pub(super) fn delete(&self, key: ObjKey) -> io::Result<()> {
        self.complete_children_of(&key)?;
        let Some(e) = self.index.lock().unwrap().remove(&key) else { return Ok(()) };
        self.free_slot(e.slot).inspect_err(|_| {
            // Not durably freed: as far as anyone knows the object is still there.
            self.index.lock().unwrap().insert(key, e);
        })
    }

    pub(super) fn rename(&self, from: ObjKey, to: ObjKey) -> io::Result<()> {
        // Both objects' dependents keep their bytes, and the renamed object is whole.
        self.complete_children_of(&from)?;
        self.complete_children_of(&to)?;
        self.complete(from)?;
        let e = self.entry(&from).ok_or_else(|| not_found(&from))?;
        let w = self.writer(&e.slot)?;
        let mut live = self.read_live(&w.f, &from, &e)?;
        live.key = to;
        let slot = self.commit_header(&w, e.slot, Some(live))?;
        let replaced = {
            let mut idx = self.index.lock().unwrap();
            idx.remove(&from);
            idx.insert(to, Entry { slot, len_bytes: e.len_bytes, base: None })
        };
        // An object already named `to` is replaced (as a file rename would). Its slot is freed
        // after the rename is durable; a crash in between leaves two claims, and open keeps the
        // newer, renamed one.
        match replaced {
            Some(old) => self.free_slot(old.slot),
            None => Ok(()),
        }
    }
}
