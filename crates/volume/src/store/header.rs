//! Slot headers and where objects live: a slot's two header copies (the current one wins by
//! generation, so a torn header write falls back to the previous one), the object and deferred-copy
//! fields they hold, and the index entry of an object (see the crash-safety rules in [`super`]).

use super::*;

/// One slot file and which of its two header copies holds its current header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SlotRef {
    pub(super) class: usize,
    pub(super) no: u64,
    /// 0 or 1; the next header write goes to the other copy.
    pub(super) current_copy: u8,
}

impl SlotRef {
    pub(super) fn next_copy(&self) -> u8 {
        self.current_copy ^ 1
    }
}

/// Where an object lives.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) slot: SlotRef,
    pub(super) len_bytes: u64,
    /// Set while the object is a deferred copy of its parent.
    pub(super) base: Option<Base>,
}

/// A `super` child's object whose copy of the parent is deferred: only the sectors in `present`
/// are in the child's slot; the others read from the parent's slot, which is collocated on this
/// shard. This takes the copy off the write path: the first child write to an object writes the
/// 4 KiB it changes (plus its header), not 64 KiB, so it costs about what a plain overwrite
/// costs.
///
/// Invariant: the parent's bytes never change while a child depends on them. Every mutation,
/// rename or delete of an object first completes its dependents (copies the missing sectors and
/// drops `base`, durably), so a crash at any point leaves either a deferred copy whose parent
/// is intact or a complete copy. The block checksums in the child's header cover the merged
/// bytes, so [`FileStore::boot`] checks a deferred copy like any other object. Parent and child
/// share a placement slot, so the core never runs two commands on them at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Base {
    /// The parent object and its slot file.
    pub(super) key: ObjKey,
    pub(super) class: usize,
    pub(super) no: u64,
    /// The parent's length when the copy was made: child bytes past it that are not present
    /// are zeroes.
    pub(super) len_bytes: u64,
    /// Bit i: sector i of the child is in the child's slot.
    pub(super) present: u32,
}

/// The object part of a live slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LiveObject {
    pub(super) key: ObjKey,
    pub(super) len_bytes: u64,
    /// The object's header as [`objfmt`] encodes it (version, block checksums).
    pub(super) objfmt_header: [u8; HEADER_COPY_BYTES],
    pub(super) base: Option<Base>,
}

/// One copy of a slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotHeader {
    pub(super) generation: u64,
    /// `None`: the slot is free.
    pub(super) object: Option<LiveObject>,
}

impl SlotHeader {
    pub(super) fn encode(&self, class: usize) -> [u8; HEADER_COPY_BYTES] {
        let mut h = [0u8; HEADER_COPY_BYTES];
        let t = TRAILER_AT;
        if let Some(o) = &self.object {
            h[..t].copy_from_slice(&o.objfmt_header[..t]);
            h[t + 16..t + 24].copy_from_slice(&o.key.table.to_le_bytes());
            h[t + 24..t + 32].copy_from_slice(&o.key.objno.to_le_bytes());
            h[t + 32..t + 40].copy_from_slice(&o.key.owner.to_le_bytes());
            h[t + 40..t + 48].copy_from_slice(&o.len_bytes.to_le_bytes());
            if let Some(b) = &o.base {
                let a = t + BASE_AT;
                h[a..a + 4].copy_from_slice(&BASE_MAGIC.to_le_bytes());
                h[a + 4..a + 8].copy_from_slice(&b.present.to_le_bytes());
                h[a + 8..a + 12].copy_from_slice(&(b.class as u32).to_le_bytes());
                h[a + 12..a + 20].copy_from_slice(&b.no.to_le_bytes());
                h[a + 20..a + 28].copy_from_slice(&b.key.table.to_le_bytes());
                h[a + 28..a + 36].copy_from_slice(&b.key.objno.to_le_bytes());
                h[a + 36..a + 44].copy_from_slice(&b.key.owner.to_le_bytes());
                h[a + 44..a + 52].copy_from_slice(&b.len_bytes.to_le_bytes());
            }
        }
        h[t..t + 4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        let state = if self.object.is_some() { STATE_LIVE } else { STATE_FREE };
        h[t + 4..t + 8].copy_from_slice(&state.to_le_bytes());
        h[t + 8..t + 16].copy_from_slice(&self.generation.to_le_bytes());
        h[t + 48..t + 56].copy_from_slice(&CLASS_DATA_BYTES[class].to_le_bytes());
        let crc = crc32c::crc32c(&h[..HEADER_CRC_AT]);
        h[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// A header copy, if it is whole (its CRC matches) and belongs to a slot of `class`.
    pub(super) fn decode(h: &[u8], class: usize) -> Option<SlotHeader> {
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
        let t = TRAILER_AT;
        if h.len() < HEADER_COPY_BYTES
            || u32_at(t) != SLOT_MAGIC
            || u32_at(HEADER_CRC_AT) != crc32c::crc32c(&h[..HEADER_CRC_AT])
            || u64_at(t + 48) != CLASS_DATA_BYTES[class]
        {
            return None;
        }
        let generation = u64_at(t + 8);
        let object = match u32_at(t + 4) {
            STATE_FREE => None,
            STATE_LIVE => {
                let len_bytes = u64_at(t + 40);
                if len_bytes > CLASS_DATA_BYTES[class] {
                    return None;
                }
                let mut objfmt_header = [0u8; HEADER_COPY_BYTES];
                objfmt_header[..t].copy_from_slice(&h[..t]);
                let a = t + BASE_AT;
                let base = match u32_at(a) {
                    BASE_MAGIC => {
                        let class = u32_at(a + 8) as usize;
                        if class >= CLASSES || len_bytes > CLASS_DATA_BYTES[LAZY_CLASS] {
                            return None;
                        }
                        Some(Base {
                            present: u32_at(a + 4),
                            class,
                            no: u64_at(a + 12),
                            key: ObjKey { table: u64_at(a + 20), objno: u64_at(a + 28), owner: u64_at(a + 36) },
                            len_bytes: u64_at(a + 44),
                        })
                    }
                    _ => None,
                };
                Some(LiveObject {
                    key: ObjKey { table: u64_at(t + 16), objno: u64_at(t + 24), owner: u64_at(t + 32) },
                    len_bytes,
                    objfmt_header,
                    base,
                })
            }
            _ => return None,
        };
        Some(SlotHeader { generation, object })
    }
}

/// The current header of a slot from its header page: the whole copy with the higher
/// generation, and which copy that is.
pub(super) fn current_header(page: &[u8], class: usize) -> Option<(u8, SlotHeader)> {
    let a = SlotHeader::decode(&page[..HEADER_COPY_BYTES], class);
    let b = SlotHeader::decode(&page[HEADER_COPY_BYTES..2 * HEADER_COPY_BYTES], class);
    match (a, b) {
        (Some(a), Some(b)) if b.generation > a.generation => Some((1, b)),
        (Some(a), _) => Some((0, a)),
        (None, Some(b)) => Some((1, b)),
        (None, None) => None,
    }
}

impl<D: StoreFs> Inner<D> {
    pub(super) fn generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }

    /// Reads a slot's header page and returns its current header.
    pub(super) fn read_header(&self, f: &D::File, class: usize) -> io::Result<Option<(u8, SlotHeader)>> {
        let mut page = [0u8; 2 * HEADER_COPY_BYTES];
        read_full_at(f, &mut page, 0)?;
        Ok(current_header(&page, class))
    }

    /// The live header of an object's slot (the index said it is there).
    pub(super) fn read_live(&self, f: &D::File, key: &ObjKey, e: &Entry) -> io::Result<LiveObject> {
        let mut sector = [0u8; HEADER_COPY_BYTES];
        read_full_at(f, &mut sector, e.slot.current_copy as u64 * HEADER_COPY_BYTES as u64)?;
        match SlotHeader::decode(&sector, e.slot.class) {
            Some(SlotHeader { object: Some(o), .. }) if o.key == *key => Ok(o),
            _ => Err(io::Error::other(format!(
                "slot {} of class {} no longer holds the header of {key:?}",
                e.slot.no, CLASS_DIR_NAMES[e.slot.class]
            ))),
        }
    }

    /// Writes a new header into the slot's other copy and makes the slot durable (its data
    /// written before, and the header, in one `fdatasync`). Returns the slot with the copy now
    /// current.
    pub(super) fn commit_header(&self, w: &SlotWriter<D::File>, slot: SlotRef, object: Option<LiveObject>) -> io::Result<SlotRef> {
        let header = SlotHeader { generation: self.generation(), object };
        let copy = slot.next_copy();
        w.write_all_at(&header.encode(slot.class), copy as u64 * HEADER_COPY_BYTES as u64)?;
        self.make_durable(w)?;
        Ok(SlotRef { current_copy: copy, ..slot })
    }
}
