//! The store's side of the write-ahead [`journal`]: a command's writes held back as its record,
//! the record's encoding (slot file, offset, bytes), replay at open, and the checkpoint that makes
//! the slot files the records dirtied durable.

use super::*;

/// A slot file opened for a mutating command. With the journal on, the command's writes are
/// held back as its journal record's payload and reach the file only once that record is
/// durable ([`Inner::make_durable`]: write-ahead); reads through it see them meanwhile.
pub(super) struct SlotWriter<F> {
    pub(super) f: F,
    pub(super) slot: SlotRef,
    /// The writes held back so far ([`encode_write`] entries), if journaling.
    pub(super) pending: Option<std::cell::RefCell<Vec<u8>>>,
}

impl<F: SlotFile> SlotWriter<F> {
    pub(super) fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match &self.pending {
            Some(p) => encode_write(&mut p.borrow_mut(), self.slot.class, self.slot.no, offset, data.len() as u64, Some(data)),
            None => self.f.write_all_at(data, offset)?,
        }
        Ok(())
    }

    pub(super) fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        match &self.pending {
            Some(p) => encode_write(&mut p.borrow_mut(), self.slot.class, self.slot.no, offset, len, None),
            None => write_zeroes_at(&self.f, offset, len)?,
        }
        Ok(())
    }

    /// Reads the file from `offset` as this command's writes so far left it.
    pub(super) fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let got = read_full_at(&self.f, buf, offset)?;
        self.overlay_pending(buf, offset)?;
        Ok(got)
    }

    /// Copies the held-back writes that overlap `buf` (read from `offset`) into it, in order.
    pub(super) fn overlay_pending(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some(p) = &self.pending else { return Ok(()) };
        let p = p.borrow();
        let end = offset + buf.len() as u64;
        for (_, at, len, data) in decode_writes(&p)? {
            let (from, to) = (at.max(offset), (at + len).min(end));
            if from >= to {
                continue;
            }
            let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
            match data {
                Some(d) => dst.copy_from_slice(&d[(from - at) as usize..(to - at) as usize]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }
}

/// Writes a journal record's writes (all to `f`, the slot file of their key) to the file.
pub(super) fn write_record<F: JournalFile>(f: &F, payload: &[u8]) -> io::Result<()> {
    for (_, offset, len, data) in decode_writes(payload)? {
        match data {
            Some(d) => f.write_all_at(d, offset)?,
            None => write_zeroes_at(f, offset, len)?,
        }
    }
    Ok(())
}

/// The journal's key for a slot file.
pub(super) fn slot_key(class: usize, no: u64) -> u64 {
    ((class as u64) << 56) | no
}

pub(super) fn slot_of_key(key: u64) -> (usize, u64) {
    ((key >> 56) as usize, key & ((1 << 56) - 1))
}

/// One write of a journal record's payload: `key u64, offset u64, len u64, zeroes u8`, then the
/// bytes unless it writes zeroes.
pub(super) fn encode_write(out: &mut Vec<u8>, class: usize, no: u64, offset: u64, len: u64, data: Option<&[u8]>) {
    out.extend_from_slice(&slot_key(class, no).to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.push(data.is_none() as u8);
    if let Some(d) = data {
        out.extend_from_slice(d);
    }
}

/// The writes of a journal record's payload: (key, offset, bytes or `None` for `len` zeroes).
pub(super) type RecordWrite<'a> = (u64, u64, u64, Option<&'a [u8]>);

pub(super) fn decode_writes(mut p: &[u8]) -> io::Result<Vec<RecordWrite<'_>>> {
    let bad = || io::Error::new(ErrorKind::InvalidData, "a journal record's payload is malformed");
    let mut out = vec![];
    while !p.is_empty() {
        if p.len() < 25 {
            return Err(bad());
        }
        let u = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().unwrap());
        let (key, offset, len, zeroes) = (u(0), u(8), u(16), p[24] != 0);
        p = &p[25..];
        if slot_of_key(key).0 >= CLASSES || offset.checked_add(len).is_none_or(|end| end > slot_file_bytes(slot_of_key(key).0)) {
            return Err(bad());
        }
        if zeroes {
            out.push((key, offset, len, None));
        } else {
            if (p.len() as u64) < len {
                return Err(bad());
            }
            out.push((key, offset, len, Some(&p[..len as usize])));
            p = &p[len as usize..];
        }
    }
    Ok(out)
}

/// Opens the journal at `root` (replaying whatever an earlier run left in it onto the slot
/// files, made durable before the journal forgets it), or creates one of `capacity` bytes; with
/// `capacity` `None`, a journal left behind is replayed and removed.
pub(super) fn open_journal<D: StoreFs>(fs: &D, root: &Path, capacity: Option<u64>) -> io::Result<Option<Journal<D::File>>> {
    let path = root.join(JOURNAL_FILE);
    let mut journal = None;
    match fs.open(&path) {
        Ok(f) => {
            let replay = Journal::open(f)?;
            if !replay.payloads.is_empty() {
                tracing::info!(records = replay.payloads.len(), "replaying the journal");
            }
            apply_records(fs, root, &replay.payloads)?;
            let cap = replay.capacity();
            let j = replay.finish()?;
            if capacity == Some(cap) {
                journal = Some(j);
            } else {
                drop(j);
                fs.remove_file(&path)?;
                fs.sync_dir(root)?;
            }
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let (None, Some(cap)) = (&journal, capacity) {
        // Made whole under another name first: a crash mid-way leaves no journal half made.
        let tmp = root.join("journal.tmp");
        let f = fs.create_truncate(&tmp)?;
        Journal::format(&f, cap)?;
        fs.rename(&tmp, &path)?;
        fs.sync_dir(root)?;
        journal = Some(Journal::open(f)?.finish()?);
    }
    Ok(journal)
}

/// Redoes journal records' writes on the slot files, in order, and syncs the files. A file
/// that is gone was a free slot the trim removed (after syncing it): nothing to restore.
pub(super) fn apply_records<D: StoreFs>(fs: &D, root: &Path, payloads: &[Vec<u8>]) -> io::Result<()> {
    let mut files: HashMap<u64, Option<D::File>> = HashMap::new();
    for p in payloads {
        for (key, offset, len, data) in decode_writes(p)? {
            let f = match files.entry(key) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let (class, no) = slot_of_key(key);
                    v.insert(match fs.open(&slot_path_in(root, class, no)) {
                        Ok(f) => Some(f),
                        Err(e) if e.kind() == ErrorKind::NotFound => None,
                        Err(e) => return Err(e),
                    })
                }
            };
            let Some(f) = f else { continue };
            match data {
                Some(d) => f.write_all_at(d, offset)?,
                None => write_zeroes_at(f, offset, len)?,
            }
        }
    }
    for f in files.values().flatten() {
        f.start_writeback();
    }
    files.values().flatten().try_for_each(|f| f.sync())
}

impl<D: StoreFs> Inner<D> {
    /// Makes the slot files the journal's records dirtied since the last checkpoint durable —
    /// only those — then frees the journal space.
    ///
    /// One device flush for all of them, not one `fdatasync` each: the writeback of every file
    /// is started, then waited for (`sync_file_range`), and the journal header's `fdatasync`
    /// that follows ([`Journal::checkpoint`]) flushes the device's write cache, completed slot
    /// writes included. That is enough because writing a slot file never changes metadata:
    /// every block of it was written (allocated) when it was made, and its size never changes.
    /// With one `fdatasync` per file, a checkpoint after a burst of writes to distinct objects
    /// cost as many flushes as the writes had saved (the store benchmark's depth-32 p99 was
    /// four times worse with the journal than without).
    pub(super) fn checkpoint(&self) -> io::Result<()> {
        let Some(j) = &self.journal else { return Ok(()) };
        j.checkpoint(|keys| {
            let mut files = Vec::with_capacity(keys.len());
            for &k in keys {
                let (class, no) = slot_of_key(k);
                match self.fs.open_read(&self.slot_path(class, no)) {
                    Ok(f) => {
                        f.start_writeback();
                        files.push(f);
                    }
                    // Removed by the trim, which synced it first.
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            files.iter().try_for_each(|f| f.wait_writeback())
        })
    }

    pub(super) fn checkpoint_loop(&self) {
        let Some(j) = &self.journal else { return };
        let mut failing_logged = false;
        while !self.shutdown.load(Ordering::SeqCst) {
            if j.wait_checkpoint_due(Duration::from_millis(REFILL_PERIOD_MS)) && !self.shutdown.load(Ordering::SeqCst) {
                match self.checkpoint() {
                    Ok(()) => failing_logged = false,
                    Err(e) => {
                        if !failing_logged {
                            tracing::warn!("journal checkpoint failed (retrying): {e}");
                            failing_logged = true;
                        }
                        std::thread::sleep(Duration::from_millis(REFILL_YIELD_MS));
                    }
                }
            }
        }
    }

    /// Makes what `w` wrote durable: one journal record (group commit) and then the writes
    /// themselves (write-ahead), or the slot file's own `fdatasync`.
    pub(super) fn make_durable(&self, w: &SlotWriter<D::File>) -> io::Result<()> {
        match (&self.journal, &w.pending) {
            (Some(j), Some(pending)) => {
                let payload = std::mem::take(&mut *pending.borrow_mut());
                j.commit_then(&payload, &[slot_key(w.slot.class, w.slot.no)], || write_record(&w.f, &payload))
            }
            _ => {
                w.f.sync()?;
                inc(&self.counters.write_fdatasyncs);
                Ok(())
            }
        }
    }

    /// Opens a slot file for a mutating command (see [`SlotWriter`]).
    pub(super) fn writer(&self, slot: &SlotRef) -> io::Result<SlotWriter<D::File>> {
        let pending = self.journal.as_ref().map(|_| std::cell::RefCell::new(Vec::new()));
        Ok(SlotWriter { f: self.open_slot(slot)?, slot: *slot, pending })
    }
}
