//! Open and boot: the directories, the scan of every slot header that rebuilds the index and free
//! lists (and applies the crash rules: older claims freed, half-made slot files removed), the
//! import of the one-file-per-object layout, and the boot report of every object's version.

use super::*;

impl<D: StoreFs> Inner<D> {
    pub(super) fn make_dirs(&self) -> io::Result<()> {
        let fresh = !self.fs.is_dir(&self.slots_dir());
        for class in 0..CLASSES {
            self.fs.create_dir_all(&self.class_dir(class))?;
        }
        if fresh {
            self.fs.sync_dir(&self.slots_dir())?;
            self.fs.sync_dir(&self.root)?;
        }
        Ok(())
    }

    /// Rebuilds the index and free lists from the slot headers.
    pub(super) fn scan(&self) -> io::Result<()> {
        let mut idx = Index { target: self.pool.free_slots_target, ..Index::default() };
        let mut max_generation = 0;
        // Key → (generation, entry) of the slot that claims it; losers are freed below.
        let mut claims: HashMap<ObjKey, (u64, Entry)> = HashMap::new();
        let mut losers = vec![];
        for class in 0..CLASSES {
            let mut free = vec![];
            for (file_name, path) in self.fs.read_dir(&self.class_dir(class))? {
                let Ok(no) = file_name.parse::<u64>() else {
                    tracing::warn!("ignoring {} (not a slot file)", path.display());
                    continue;
                };
                idx.next_slot_no[class] = idx.next_slot_no[class].max(no + 1);
                idx.in_use[class] = true;
                let f = self.fs.open(&path)?;
                let file_bytes = f.len()?;
                let current = self.read_header(&f, class)?;
                let slot = SlotRef { class, no, current_copy: current.as_ref().map_or(1, |(c, _)| *c) };
                match current {
                    Some((_, SlotHeader { generation, object: Some(o) })) => {
                        max_generation = max_generation.max(generation);
                        if file_bytes < slot_file_bytes(class) {
                            // Never written so; keep the object (its checksums will judge it).
                            tracing::warn!("slot {} is short; extending it", path.display());
                            // With zeroes written, not a hole: every block of a slot file stays
                            // allocated, so writing it never changes metadata (the checkpoint
                            // relies on that).
                            write_zeroes_at(&f, file_bytes, slot_file_bytes(class) - file_bytes)?;
                            f.sync()?;
                        }
                        // Two slots claim one key after a crash in the middle of a move or of a
                        // rename onto an existing key: the higher generation is the newer.
                        let entry = Entry { slot, len_bytes: o.len_bytes, base: o.base };
                        match claims.insert(o.key, (generation, entry)) {
                            Some((g, other)) if g > generation => {
                                claims.insert(o.key, (g, other));
                                losers.push(slot);
                            }
                            Some((_, other)) => losers.push(other.slot),
                            None => {}
                        }
                    }
                    header => {
                        if file_bytes != slot_file_bytes(class) || f.has_hole(file_bytes) {
                            // A creation a crash interrupted: it never held an object.
                            self.fs.remove_file(&path)?;
                            inc(&self.counters.open_partial_slots_removed);
                            continue;
                        }
                        if let Some((_, h)) = header {
                            max_generation = max_generation.max(h.generation);
                        }
                        free.push(slot);
                    }
                }
            }
            free.sort_by_key(|s| std::cmp::Reverse(s.no));
            idx.free[class] = free.into();
        }
        // In key order, so the index (its lists of deferred children) does not depend on the
        // hash map's order: a simulation seed replays the same store operations.
        let mut claims: Vec<(ObjKey, Entry)> = claims.into_iter().map(|(k, (_, e))| (k, e)).collect();
        claims.sort_by_key(|(k, _)| *k);
        for (k, e) in claims {
            idx.insert(k, e);
        }
        self.next_generation.store(max_generation + 1, Ordering::Relaxed);
        *self.index.lock().unwrap() = idx;
        for slot in losers {
            tracing::warn!("slot {} of class {} held an older copy of a moved or renamed object: freeing it", slot.no, CLASS_DIR_NAMES[slot.class]);
            self.free_slot(slot)?;
            inc(&self.counters.open_older_claims_freed);
        }
        Ok(())
    }

    /// Moves objects of the one-file-per-object layout (`objects/<table>/<objno>.<owner>`, an
    /// objfmt file each) into slots, byte for byte with their headers, so a damaged one stays
    /// suspect. Each file is removed once its slot is durable; a crash in between imports it
    /// again and open's duplicate rule keeps the newer slot.
    pub(super) fn import_one_file_per_object_layout(&self) -> io::Result<()> {
        let old = self.root.join("objects");
        if !self.fs.is_dir(&old) {
            return Ok(());
        }
        for (table_name, table_path) in self.fs.read_dir(&old)? {
            let Ok(table) = u64::from_str_radix(&table_name, 16) else { continue };
            for (name, path) in self.fs.read_dir(&table_path)? {
                let key = name.split_once('.').and_then(|(objno, owner)| {
                    Some(ObjKey {
                        table,
                        objno: u64::from_str_radix(objno, 16).ok()?,
                        owner: u64::from_str_radix(owner, 16).ok()?,
                    })
                });
                if let Some(key) = key {
                    let f = self.fs.open_read(&path)?;
                    let body_bytes = f.len()?.saturating_sub(HEADER_BYTES);
                    if body_bytes > MAX_OBJECT_SIZE_BYTES as u64 {
                        tracing::warn!("{} is larger than any object: left in place", path.display());
                        continue;
                    }
                    let mut objfmt_header = [0u8; HEADER_COPY_BYTES];
                    read_full_at(&f, &mut objfmt_header, 0)?;
                    if objfmt::Header::decode(&objfmt_header).is_none() {
                        // A torn header: the object is kept, as suspect.
                        objfmt_header = objfmt::Header { version: objfmt::SUSPECT, crcs: vec![] }.encode();
                    }
                    let mut body = vec![0u8; body_bytes as usize];
                    read_full_at(&f, &mut body, HEADER_BYTES)?;
                    self.write_fresh(key, MemObject { objfmt_header, body })?;
                }
                // Objects imported, and leftover temporaries of an interrupted copy.
                self.fs.remove_file(&path)?;
            }
            self.fs.remove_dir(&table_path)?;
        }
        self.fs.remove_dir(&old)?;
        self.fs.sync_dir(&self.root)
    }

    pub(super) fn boot(&self) -> io::Result<Boot> {
        let mut boot = Boot::default();
        let mut entries: Vec<(ObjKey, Entry)> =
            self.index.lock().unwrap().objects.iter().map(|(k, e)| (*k, *e)).collect();
        entries.sort_by_key(|(k, _)| *k);
        for (key, e) in entries {
            let version = if e.base.is_some() {
                // A deferred copy: its checksums cover the bytes merged with the parent's.
                objfmt::verify(&mut self.load(&key, &e)?)?
            } else {
                // Read only: no journal record.
                let w = SlotWriter { f: self.open_slot(&e.slot)?, slot: e.slot, pending: None };
                let live = self.read_live(&w.f, &key, &e)?;
                objfmt::verify(&mut SlotObject {
                    file: &w,
                    objfmt_header: live.objfmt_header,
                    len_bytes: e.len_bytes,
                    capacity_bytes: CLASS_DATA_BYTES[e.slot.class],
                })?
            };
            if version == objfmt::SUSPECT {
                tracing::warn!("object {key:?} does not match its checksums (interrupted write): it will be re-replicated");
            }
            boot.objects.push((key, version));
            if key.objno == TRACK_OBJNO && version != objfmt::SUSPECT {
                boot.track_objects.push((key, self.load(&key, &e)?.body));
            }
        }
        match self.fs.read(&self.root.join("state")) {
            Ok(b) => boot.state = Some(b),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(boot)
    }
}
