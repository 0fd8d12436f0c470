//! The objects [`objfmt`] applies a mutation to: an object in its slot ([`SlotObject`]), one built
//! in memory ([`MemObject`]), or the few sectors of a deferred copy a small write touches
//! ([`Window`]); and what a write to a deferred copy claims as its own.

use super::*;

/// An object in its slot as [`objfmt`] sees an object file: the objfmt header at offset 0, the
/// object's bytes from [`HEADER_BYTES`]. The length comes from the slot header, not the file
/// size; growing the object zeroes the stale bytes it takes in; shrinking it (`Put`) only lowers
/// the length — nothing is truncated or deallocated, so no metadata changes. The new objfmt
/// header is kept here; the store writes it into the slot header.
pub(super) struct SlotObject<'a, F: SlotFile> {
    pub(super) file: &'a SlotWriter<F>,
    pub(super) objfmt_header: [u8; HEADER_COPY_BYTES],
    pub(super) len_bytes: u64,
    pub(super) capacity_bytes: u64,
}

impl<F: SlotFile> SlotObject<'_, F> {
    pub(super) fn grow_to(&mut self, len_bytes: u64) -> io::Result<()> {
        if len_bytes > self.capacity_bytes {
            return Err(invalid(format!("object of {len_bytes} bytes does not fit its {} byte slot", self.capacity_bytes)));
        }
        if len_bytes > self.len_bytes {
            self.file.write_zeroes_at(SLOT_HEADER_PAGE_BYTES + self.len_bytes, len_bytes - self.len_bytes)?;
            self.len_bytes = len_bytes;
        }
        Ok(())
    }
}

impl<F: SlotFile> ObjFile for SlotObject<'_, F> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset < HEADER_BYTES {
            // objfmt reads its header whole, at offset 0.
            let n = buf.len().min(HEADER_COPY_BYTES - offset as usize);
            buf[..n].copy_from_slice(&self.objfmt_header[offset as usize..offset as usize + n]);
            return Ok(n);
        }
        let at = offset - HEADER_BYTES;
        let n = (buf.len() as u64).min(self.len_bytes.saturating_sub(at)) as usize;
        let got = self.file.read_at(&mut buf[..n], SLOT_HEADER_PAGE_BYTES + at)?;
        // A slot file is never short; if one were, its missing bytes read as zeroes (and fail
        // the checksums).
        buf[got..n].fill(0);
        Ok(n)
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        if at > self.len_bytes {
            self.grow_to(at)?;
        }
        if at + data.len() as u64 > self.capacity_bytes {
            return Err(invalid("write past the end of the slot".into()));
        }
        self.file.write_all_at(data, SLOT_HEADER_PAGE_BYTES + at)?;
        self.len_bytes = self.len_bytes.max(at + data.len() as u64);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.len_bytes)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let len_bytes = len.saturating_sub(HEADER_BYTES);
        if len_bytes <= self.len_bytes {
            self.len_bytes = len_bytes;
            Ok(())
        } else {
            self.grow_to(len_bytes)
        }
    }

    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        // Zeroes are written, not punched: a hole would have to be reallocated (metadata) by the
        // next write.
        let at = offset.saturating_sub(HEADER_BYTES);
        let end = (at + len).min(self.len_bytes);
        if end > at {
            self.file.write_zeroes_at(SLOT_HEADER_PAGE_BYTES + at, end - at)?;
        }
        Ok(())
    }

    fn crc_range(&mut self, offset: u64, len: u64) -> io::Result<u32> {
        // Every write checksums a whole 64 KiB block: read it into uninitialised capacity
        // rather than a zeroed buffer (one pass over the block fewer).
        let at = offset.saturating_sub(HEADER_BYTES).min(self.len_bytes);
        let n = len.min(self.len_bytes - at);
        let mut buf = self.file.f.read_vec(SLOT_HEADER_PAGE_BYTES + at, n)?;
        buf.resize(n as usize, 0);
        self.file.overlay_pending(&mut buf, SLOT_HEADER_PAGE_BYTES + at)?;
        Ok(crc32c::crc32c(&buf))
    }
}

/// What both object adapters do first in `write_at`: objfmt writes its header whole at offset 0,
/// into the slot header's copy; a partial header write is refused; an empty write does nothing
/// (as on a file, it does not extend it). Returns the body offset of anything else.
pub(super) fn body_write_offset(header: &mut [u8; HEADER_COPY_BYTES], data: &[u8], offset: u64) -> io::Result<Option<u64>> {
    if offset == 0 && data.len() == HEADER_COPY_BYTES {
        header.copy_from_slice(data);
        return Ok(None);
    }
    if offset < HEADER_BYTES {
        return Err(invalid("partial object header write".into()));
    }
    Ok((!data.is_empty()).then_some(offset - HEADER_BYTES))
}

/// An object built in memory before it goes into a fresh slot in one write: a new object, a
/// copy-on-write copy of its parent, or an object moving to a bigger class.
pub(crate) struct MemObject {
    pub(crate) objfmt_header: [u8; HEADER_COPY_BYTES],
    pub(crate) body: Vec<u8>,
}

impl ObjFile for MemObject {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let (src, at): (&[u8], u64) =
            if offset < HEADER_BYTES { (&self.objfmt_header, offset) } else { (&self.body, offset - HEADER_BYTES) };
        let at = (at as usize).min(src.len());
        let n = buf.len().min(src.len() - at);
        buf[..n].copy_from_slice(&src[at..at + n]);
        Ok(n)
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        let at = at as usize;
        if at + data.len() > MAX_OBJECT_SIZE_BYTES as usize {
            return Err(invalid("object larger than 4 MiB".into()));
        }
        if self.body.len() < at + data.len() {
            self.body.resize(at + data.len(), 0);
        }
        self.body[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.body.len() as u64)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.body.resize(len.saturating_sub(HEADER_BYTES) as usize, 0);
        Ok(())
    }

    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let at = (offset.saturating_sub(HEADER_BYTES) as usize).min(self.body.len());
        let end = (at + len as usize).min(self.body.len());
        self.body[at..end].fill(0);
        Ok(())
    }

    fn crc_range(&mut self, offset: u64, len: u64) -> io::Result<u32> {
        // Checksummed where it lies: no copy (a copy-on-write checksums a block per write).
        let at = (offset.saturating_sub(HEADER_BYTES) as usize).min(self.body.len());
        let end = (at + len as usize).min(self.body.len());
        Ok(crc32c::crc32c(&self.body[at..end]))
    }
}

/// What [`Inner::apply_lazy`] applies a write to: the whole object in memory, or only the
/// sectors a small write touches.
pub(super) enum LazySource {
    Whole(MemObject),
    Window(Window),
}

/// Some whole sectors of an object, `start` bytes into it, and its header: enough for
/// [`objfmt::apply`] of a write inside them ([`objfmt::small_write_fits`]), which reads and
/// writes only the written range and the header. Anything else is refused with an error.
pub(super) struct Window {
    pub(super) objfmt_header: [u8; HEADER_COPY_BYTES],
    pub(super) len_bytes: u64,
    pub(super) start: u64,
    pub(super) bytes: Vec<u8>,
}

impl Window {
    pub(super) fn range(&self, at: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        match at.checked_sub(self.start) {
            Some(x) if x as usize + len <= self.bytes.len() => Ok(x as usize..x as usize + len),
            _ => Err(io::Error::other("deferred copy: access outside the sectors read")),
        }
    }
}

impl ObjFile for Window {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset < HEADER_BYTES {
            let n = buf.len().min(HEADER_COPY_BYTES - offset as usize);
            buf[..n].copy_from_slice(&self.objfmt_header[offset as usize..offset as usize + n]);
            return Ok(n);
        }
        let r = self.range(offset - HEADER_BYTES, buf.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(buf.len())
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        let r = self.range(at, data.len())?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.len_bytes)
    }

    fn set_len(&mut self, _len: u64) -> io::Result<()> {
        Err(io::Error::other("deferred copy: a window cannot change length"))
    }

    fn zero_range(&mut self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::other("deferred copy: a window takes writes only"))
    }

    fn crc_range(&mut self, _offset: u64, _len: u64) -> io::Result<u32> {
        Err(io::Error::other("deferred copy: a window has not every byte of a block"))
    }
}

/// The object's length after `op`, as [`objfmt::apply`] makes it.
/// What a child's write to a deferred copy makes its own: the written range, plus the zeroes
/// between the old end and the write when it grows the object. Marks those sectors present in
/// `present` and returns the byte range of whole sectors to write (clipped to the new length)
/// and whether the copy is now complete (every sector of the object present).
pub(crate) fn claim_sectors(present: &mut u32, old_len: u64, new_len: u64, op: &RepOp) -> (u64, u64, bool) {
    let (mut start, mut end) = match op {
        RepOp::Write { offset, data } => (*offset as u64, *offset as u64 + data.len() as u64),
        RepOp::Zero { offset, len } => (*offset as u64, (*offset as u64 + *len as u64).min(old_len)),
        RepOp::Put { .. } => unreachable!("a Put is never a deferred copy"),
    };
    if new_len > old_len {
        (start, end) = (start.min(old_len), end.max(new_len));
    }
    let (s0, s1) = (start / LAZY_SECTOR_BYTES, end.div_ceil(LAZY_SECTOR_BYTES));
    for s in s0..s1 {
        *present |= 1 << s;
    }
    let all = (1u64 << new_len.div_ceil(LAZY_SECTOR_BYTES)) - 1;
    (s0 * LAZY_SECTOR_BYTES, (s1 * LAZY_SECTOR_BYTES).min(new_len), u64::from(*present) & all == all)
}

pub(crate) fn len_after(len_bytes: u64, op: &RepOp) -> u64 {
    match op {
        RepOp::Put { data } => data.len() as u64,
        RepOp::Write { data, .. } if data.is_empty() => len_bytes,
        RepOp::Write { offset, data } => len_bytes.max(*offset as u64 + data.len() as u64),
        RepOp::Zero { .. } => len_bytes,
    }
}
