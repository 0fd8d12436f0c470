//! Slot allocation and the pool of free slots: taking a slot (from the reservation of a `super`
//! child, the free list, or created inline), creating slot files, the background refill and trim,
//! and `super`'s pre-stocking.

use super::*;

impl<D: StoreFs> Inner<D> {
    /// Pre-stocking for a new `super` child of `parent`: the child's first write to each of
    /// the parent's objects here takes a free slot of the class the parent object sits in (a
    /// deferred copy of a 64 KiB-class object, a whole copy of a bigger one), so each class
    /// reserves as many slots as there are such parent objects (at most
    /// [`PoolOptions::reserved_slots_max`]). Free slots the pool holds move into the reservation
    /// at once (in memory); the refill is woken to make the rest, and to restock the free list.
    /// Costs one pass over the index, off the write path.
    pub(super) fn prestock(&self, table: TableId, parent: VolId) {
        let mut want = [0usize; CLASSES];
        {
            let mut idx = self.index.lock().unwrap();
            for (k, e) in &idx.objects {
                if k.table == table && k.owner == parent && k.objno != TRACK_OBJNO {
                    want[e.slot.class] += 1;
                }
            }
            for (class, &n) in want.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let t = n.min(self.pool.reserved_slots_max[class]);
                idx.in_use[class] = true;
                idx.reserved[class] = idx.reserved[class].max(t);
                idx.reserved_touched_us[class] = self.now_us();
                idx.rebalance_reserve(class);
            }
        }
        self.prestocks.fetch_add(1, Ordering::Relaxed);
        self.wake_refill();
    }

    pub(super) fn now_us(&self) -> u64 {
        (self.opened.elapsed().as_micros() as u64).max(1)
    }

    /// A free slot of `class`: from the pool, else created now (the slow path), else — on a
    /// full disk — a free slot of a bigger class, or one set aside for children.
    /// `child_first_write`: for a `super` child's first write to an object, which takes a slot
    /// of the reservation ([`Index::reserved_free`]) if there is one ready, and counts one off
    /// the slots owed. Every other allocation leaves the reservation alone.
    pub(super) fn take_slot(&self, class: usize, child_first_write: bool) -> io::Result<SlotRef> {
        {
            let mut idx = self.index.lock().unwrap();
            idx.in_use[class] = true;
            if child_first_write && idx.reserved[class] > 0 {
                idx.reserved[class] -= 1;
                idx.reserved_touched_us[class] = self.now_us();
                if let Some(slot) = idx.reserved_free[class].pop_back() {
                    inc(&self.counters.slots_from_pool);
                    inc(&self.counters.slots_from_reserve);
                    return Ok(slot);
                }
            }
            if let Some(slot) = idx.free[class].pop_back() {
                inc(&self.counters.slots_from_pool);
                let low = idx.free[class].len() < idx.goal(class, &self.pool.free_slots_max);
                drop(idx);
                if low {
                    self.wake_refill();
                }
                return Ok(slot);
            }
        }
        {
            // The pool was too small for this burst: keep twice as many ready.
            let mut idx = self.index.lock().unwrap();
            idx.target[class] = (idx.target[class] * 2).max(1).min(self.pool.free_slots_max[class]);
            idx.ran_dry[class] = true;
        }
        self.wake_refill();
        let slow = self.slow_allocations.fetch_add(1, Ordering::Relaxed) + 1;
        // At most one line a second: a fill of a new volume runs the pool dry on every write.
        let now_us = (self.opened.elapsed().as_micros() as u64).max(1);
        let logged = self.dry_logged_us.load(Ordering::Relaxed);
        if (logged == 0 || now_us.saturating_sub(logged) >= 1_000_000)
            && self.dry_logged_us.compare_exchange(logged, now_us, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            tracing::info!(class = CLASS_DIR_NAMES[class], slow_allocations = slow, "slot pool ran dry: a write creates its slot itself");
        }
        match self.create_slots(class, 1) {
            Ok(mut made) => {
                inc(&self.counters.write_dir_fsyncs);
                Ok(made.pop().expect("one slot made"))
            }
            Err(e) if is_no_space(&e) => {
                // A write that can still land beats a slot kept for a child that may never
                // write (the refill makes it again once there is space).
                let mut idx = self.index.lock().unwrap();
                (class..CLASSES).find_map(|c| idx.free[c].pop_back().or_else(|| idx.reserved_free[c].pop_back())).ok_or(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Creates `count` slot files of `class`: each written whole (a free header, then zeroes)
    /// and synced, then the directory synced. On any error every file of the batch is removed.
    pub(super) fn create_slots(&self, class: usize, count: usize) -> io::Result<Vec<SlotRef>> {
        let first_no = {
            let mut idx = self.index.lock().unwrap();
            let no = idx.next_slot_no[class];
            idx.next_slot_no[class] += count as u64;
            no
        };
        let mut page = vec![0u8; SLOT_HEADER_PAGE_BYTES as usize];
        page[..HEADER_COPY_BYTES].copy_from_slice(&SlotHeader { generation: 0, object: None }.encode(class));
        let mut made: Vec<(PathBuf, D::File)> = Vec::with_capacity(count);
        let result = (|| {
            for no in first_no..first_no + count as u64 {
                let path = self.slot_path(class, no);
                let f = self.fs.create_new(&path)?;
                made.push((path, f));
                let f = &made.last().unwrap().1;
                f.write_all_at(&page, 0)?;
                write_zeroes_at(f, SLOT_HEADER_PAGE_BYTES, CLASS_DATA_BYTES[class])?;
            }
            for (_, f) in &made {
                f.start_writeback();
            }
            for (_, f) in &made {
                f.sync()?;
            }
            self.fs.sync_dir(&self.class_dir(class))
        })();
        match result {
            Ok(()) => Ok((first_no..first_no + count as u64).map(|no| SlotRef { class, no, current_copy: 0 }).collect()),
            Err(e) => {
                for (path, _) in &made {
                    let _ = self.fs.remove_file(path);
                }
                Err(e)
            }
        }
    }

    pub(super) fn wake_refill(&self) {
        if self.pool.background_refill {
            *self.refill_wanted.lock().unwrap() = true;
            self.refill_cv.notify_one();
        }
    }

    pub(super) fn refill_loop(&self) {
        let mut last_decay = std::time::Instant::now();
        let mut held_back = false;
        loop {
            {
                let wanted = self.refill_wanted.lock().unwrap();
                let period = if held_back { REFILL_YIELD_MS } else { REFILL_PERIOD_MS };
                let (mut wanted, _) = self
                    .refill_cv
                    .wait_timeout_while(wanted, Duration::from_millis(period), |w| {
                        !*w && !self.shutdown.load(Ordering::SeqCst)
                    })
                    .unwrap();
                *wanted = false;
            }
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            if last_decay.elapsed() >= Duration::from_millis(REFILL_PERIOD_MS) {
                last_decay = std::time::Instant::now();
                let mut idx = self.index.lock().unwrap();
                let now_us = self.now_us();
                for class in 0..CLASSES {
                    if !std::mem::take(&mut idx.ran_dry[class]) {
                        let base = self.pool.free_slots_target[class];
                        let t = idx.target[class];
                        idx.target[class] = base.max(t - (t / 4).max(1).min(t));
                    }
                    if idx.reserved[class] > 0 && now_us.saturating_sub(idx.reserved_touched_us[class]) >= RESERVE_IDLE_MS * 1000 {
                        // The ready slots go back to the free list (trimmed to its maximum).
                        idx.reserved[class] = 0;
                        idx.rebalance_reserve(class);
                    }
                }
            }
            held_back = false;
            for class in 0..CLASSES {
                held_back |= self.refill(class);
                self.trim(class);
            }
        }
    }

    /// Whether a write started in the last [`REFILL_YIELD_MS`].
    pub(super) fn serving_writes(&self) -> bool {
        let last = self.last_write_us.load(Ordering::Relaxed);
        last != 0 && (self.opened.elapsed().as_micros() as u64).saturating_sub(last) < REFILL_YIELD_MS * 1000
    }

    /// Tops up the free slots of a class in use, in batches, while the disk has room to spare.
    /// Returns true if it held back for the shard's writes (see [`REFILL_FLOOR_DIVISOR`]): the
    /// loop then looks again soon.
    pub(super) fn refill(&self, class: usize) -> bool {
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return false;
            }
            // The free list and the reservation (slots set aside for `super` children).
            let (free, target, reserved_free, owed, in_use) = {
                let idx = self.index.lock().unwrap();
                let c = class;
                (idx.free[c].len(), idx.goal(c, &self.pool.free_slots_max), idx.reserved_free[c].len(), idx.reserved[c], idx.in_use[c])
            };
            let need = target.saturating_sub(free) + owed.saturating_sub(reserved_free);
            if !in_use || need == 0 {
                return false;
            }
            let above_floor = |have: usize, goal: usize| have >= goal || have >= (goal / REFILL_FLOOR_DIVISOR).max(1);
            if above_floor(free, target) && above_floor(reserved_free, owed) && self.serving_writes() {
                return true;
            }
            let batch_slots = ((REFILL_BATCH_BYTES / slot_file_bytes(class)).max(1) as usize).min(REFILL_BATCH_MAX_SLOTS);
            let count = need.min(batch_slots);
            let need_bytes = count as u64 * slot_file_bytes(class);
            match self.fs.available_bytes(&self.root) {
                Ok(avail) if avail >= self.pool.reserve_bytes + need_bytes => {}
                Ok(_) => return false, // the disk is nearly full: leave its space to writes
                Err(e) => {
                    tracing::warn!("slot refill cannot check free space: {e}");
                    return false;
                }
            }
            inc(&self.counters.refill_batches);
            if self.serving_writes() {
                inc(&self.counters.refill_batches_while_serving);
            }
            let t = std::time::Instant::now();
            let created = self.create_slots(class, count);
            add_us(&self.counters.refill_us, t);
            match created {
                Ok(made) => {
                    self.counters.refill_slots.fetch_add(made.len() as u64, Ordering::Relaxed);
                    let mut idx = self.index.lock().unwrap();
                    for slot in made {
                        if idx.reserve_deficit(class) > 0 {
                            idx.reserved_free[class].push_front(slot);
                        } else {
                            idx.free[class].push_front(slot);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("slot refill of class {} failed: {e}", CLASS_DIR_NAMES[class]);
                    return false;
                }
            }
        }
    }

    /// Deletes free slots beyond the class's maximum. The unlinks need no directory fsync: a
    /// slot whose deletion a crash undoes is just a free slot again.
    pub(super) fn trim(&self, class: usize) {
        let extra: Vec<SlotRef> = {
            let mut idx = self.index.lock().unwrap();
            let over = idx.free[class].len().saturating_sub(self.pool.free_slots_max[class]);
            idx.free[class].drain(..over).collect()
        };
        for slot in extra {
            if self.journal.is_some() {
                // Its free header may so far be durable only in the journal: were the removal
                // lost in a crash, the file would come back with whatever it held before.
                if let Err(e) = self.fs.open_read(&self.slot_path(slot.class, slot.no)).and_then(|f| f.sync()) {
                    tracing::warn!("cannot sync free slot {} before deleting it: {e}", self.slot_path(slot.class, slot.no).display());
                    self.index.lock().unwrap().free[class].push_front(slot);
                    continue;
                }
            }
            if let Err(e) = self.fs.remove_file(&self.slot_path(slot.class, slot.no)) {
                tracing::warn!("cannot delete free slot {}: {e}", self.slot_path(slot.class, slot.no).display());
            }
        }
    }
}
