//! The on-disk format of one object (its header inside a slot header; see [`super`]).
//!
//! An object file is a 512-byte header followed by the object's bytes (sparse: unwritten ranges
//! read as zeroes). The header holds the object's [`Version`] and a CRC32C of every 64 KiB block
//! of the bytes. It fits in one disk sector, so it is written whole or not at all.
//!
//! Why the checksums: a shard that loses power in the middle of a write may keep the new header
//! and lose the data, keep the data and lose the header, or keep part of either. Versions alone
//! would then claim a content the object does not have. At start a shard checks every object
//! against its checksums and marks a mismatching one [`SUSPECT`]: re-replication then fetches
//! it whole from its primary instead of trusting it.

use std::io;

use crate::types::{RepOp, Version};

pub const HEADER_BYTES: u64 = 512;
pub const CRC_BLOCK_BYTES: u64 = 64 * 1024;
/// Largest object: 64 blocks of 64 KiB (the 4 MiB object size limit).
pub const MAX_CRC_BLOCKS: usize = 64;
const MAGIC: u32 = 0x554e_4f31; // "UNO1"

/// The version a shard gives an object whose content does not match its checksums. Every
/// comparison with a real version fails, so the object is refetched; a new write on top (when
/// this is the only copy left) still gets a higher sequence number.
pub const SUSPECT: Version = Version { epoch: 0, seq: 1 << 62 };

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    pub version: Version,
    pub crcs: Vec<u32>,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES as usize] {
        assert!(self.crcs.len() <= MAX_CRC_BLOCKS, "object larger than 4 MiB");
        let mut h = [0u8; HEADER_BYTES as usize];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&(self.crcs.len() as u32).to_le_bytes());
        h[8..16].copy_from_slice(&self.version.epoch.to_le_bytes());
        h[16..24].copy_from_slice(&self.version.seq.to_le_bytes());
        for (i, c) in self.crcs.iter().enumerate() {
            h[24 + 4 * i..28 + 4 * i].copy_from_slice(&c.to_le_bytes());
        }
        h
    }

    pub fn decode(h: &[u8]) -> Option<Header> {
        if h.len() < HEADER_BYTES as usize || u32::from_le_bytes(h[0..4].try_into().unwrap()) != MAGIC {
            return None;
        }
        let n = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        if n > MAX_CRC_BLOCKS {
            return None;
        }
        let version = Version {
            epoch: u64::from_le_bytes(h[8..16].try_into().unwrap()),
            seq: u64::from_le_bytes(h[16..24].try_into().unwrap()),
        };
        let crcs = (0..n).map(|i| u32::from_le_bytes(h[24 + 4 * i..28 + 4 * i].try_into().unwrap())).collect();
        Some(Header { version, crcs })
    }
}

/// The few file operations an object needs.
pub trait ObjFile {
    /// Reads into `buf` from `offset`; returns how many bytes exist there (short at the end).
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()>;
    fn len(&mut self) -> io::Result<u64>;
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// Makes `[offset, offset+len)` read as zeroes without changing the length.
    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// CRC32C of the bytes in `[offset, offset+len)` that exist. The default reads them; a file
    /// that holds its bytes in memory can checksum them where they are.
    fn crc_range(&mut self, offset: u64, len: u64) -> io::Result<u32> {
        let mut buf = vec![0u8; len as usize];
        let got = self.read_at(&mut buf, offset)?;
        buf.truncate(got);
        Ok(crc32c::crc32c(&buf))
    }
}

fn block_crc<F: ObjFile>(f: &mut F, block: usize, data_len: u64) -> io::Result<u32> {
    let start = block as u64 * CRC_BLOCK_BYTES;
    let n = CRC_BLOCK_BYTES.min(data_len.saturating_sub(start));
    f.crc_range(HEADER_BYTES + start, n)
}

pub fn read_header<F: ObjFile>(f: &mut F) -> io::Result<Option<Header>> {
    let mut h = vec![0u8; HEADER_BYTES as usize];
    let got = f.read_at(&mut h, 0)?;
    Ok(if got < HEADER_BYTES as usize { None } else { Header::decode(&h) })
}

/// Applies a mutation to an object file (created empty, or a copy for copy-on-write) and
/// rewrites its header with `version` and the checksums of the blocks it changed.
pub fn apply<F: ObjFile>(f: &mut F, version: Version, op: &RepOp) -> io::Result<()> {
    let mut header = read_header(f)?.unwrap_or_default();
    let old_len = f.len()?.saturating_sub(HEADER_BYTES);
    if let RepOp::Write { offset, data } = op {
        if apply_small_write(f, &mut header, old_len, *offset as u64, data)? {
            header.version = version;
            return f.write_at(&header.encode(), 0);
        }
    }
    let (start, end) = match op {
        RepOp::Put { data } => {
            f.set_len(HEADER_BYTES)?;
            f.write_at(data, HEADER_BYTES)?;
            header.crcs.clear();
            (0, data.len() as u64)
        }
        RepOp::Write { offset, data } => {
            f.write_at(data, HEADER_BYTES + *offset as u64)?;
            (*offset as u64, *offset as u64 + data.len() as u64)
        }
        RepOp::Zero { offset, len } => {
            let end = (*offset as u64 + *len as u64).min(old_len);
            if end > *offset as u64 {
                f.zero_range(HEADER_BYTES + *offset as u64, end - *offset as u64)?;
            }
            (*offset as u64, end.max(*offset as u64))
        }
    };
    let data_len = f.len()?.saturating_sub(HEADER_BYTES);
    let blocks = data_len.div_ceil(CRC_BLOCK_BYTES) as usize;
    if blocks > MAX_CRC_BLOCKS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "object larger than 4 MiB"));
    }
    // Blocks the write touched, and any block from the one holding the old end (it may have
    // grown from a partial block to a whole one) to the write (a hole).
    let first = ((start.min(old_len) / CRC_BLOCK_BYTES) as usize).min(header.crcs.len());
    let last = if data_len > old_len { blocks } else { end.div_ceil(CRC_BLOCK_BYTES) as usize };
    header.crcs.resize(blocks, 0);
    for b in first..last.min(blocks) {
        header.crcs[b] = block_crc(f, b, data_len)?;
    }
    header.version = version;
    f.write_at(&header.encode(), 0)
}

/// A write inside one checksum block of the object's existing bytes: the block's checksum is
/// updated from the bytes the write replaces ([`crc_after_overwrite`]), so only those are read
/// — not the whole 64 KiB block, which every 4 KiB write read and checksummed before. Returns
/// `false` (and does nothing) for any other write. A block whose stored checksum was already
/// wrong stays wrong, so it is still found suspect.
fn apply_small_write<F: ObjFile>(f: &mut F, header: &mut Header, old_len: u64, offset: u64, data: &[u8]) -> io::Result<bool> {
    if !small_write_fits(header, old_len, offset, data.len() as u64) {
        return Ok(false);
    }
    let end = offset + data.len() as u64;
    let block = (offset / CRC_BLOCK_BYTES) as usize;
    let mut old = vec![0u8; data.len()];
    if f.read_at(&mut old, HEADER_BYTES + offset)? != old.len() {
        return Ok(false);
    }
    f.write_at(data, HEADER_BYTES + offset)?;
    let block_end = ((block as u64 + 1) * CRC_BLOCK_BYTES).min(old_len);
    header.crcs[block] = crc_after_overwrite(header.crcs[block], &old, data, block_end - end);
    Ok(true)
}

/// Whether a write of `len` bytes at `offset` into an object of `old_len` bytes with `header`
/// takes the path of [`apply_small_write`]: inside the existing bytes and one checksum block.
pub fn small_write_fits(header: &Header, old_len: u64, offset: u64, len: u64) -> bool {
    let end = offset + len;
    len > 0
        && end <= old_len
        && offset / CRC_BLOCK_BYTES == (end - 1) / CRC_BLOCK_BYTES
        && header.crcs.len() as u64 == old_len.div_ceil(CRC_BLOCK_BYTES)
}

/// The CRC32C of a message after `old` (followed by `after` more bytes) is overwritten with
/// `new` of the same length, from the message's CRC. CRC32C is affine over GF(2): for equal
/// lengths crc(X) ^ crc(Y) depends only on X ^ Y, linearly, and a difference followed by `after`
/// unchanged bytes is the difference's CRC shifted through `after` zero bytes. So
/// `crc(Y) = crc(X) ^ shift(crc(old) ^ crc(new), after)`.
pub fn crc_after_overwrite(crc: u32, old: &[u8], new: &[u8], after: u64) -> u32 {
    debug_assert_eq!(old.len(), new.len());
    crc ^ crc_shift_zeroes(crc32c::crc32c(old) ^ crc32c::crc32c(new), after)
}

/// Operators that append 2^k zero bytes to a raw CRC32C register, k = 0..64: 32 columns each.
fn zero_operators() -> &'static [[u32; 32]; 64] {
    static OPS: std::sync::OnceLock<Box<[[u32; 32]; 64]>> = std::sync::OnceLock::new();
    OPS.get_or_init(|| {
        fn square(m: &[u32; 32]) -> [u32; 32] {
            std::array::from_fn(|i| gf2_times(m, m[i]))
        }
        // One zero bit (the reflected CRC32C polynomial), then squared to one zero byte.
        let mut op: [u32; 32] = std::array::from_fn(|i| if i == 0 { 0x82F6_3B78 } else { 1 << (i - 1) });
        for _ in 0..3 {
            op = square(&op);
        }
        let mut ops = Box::new([[0u32; 32]; 64]);
        for k in 0..64 {
            ops[k] = op;
            op = square(&op);
        }
        ops
    })
}

/// A raw CRC32C register after `n` more zero bytes.
fn crc_shift_zeroes(mut v: u32, n: u64) -> u32 {
    let ops = zero_operators();
    for (k, m) in ops.iter().enumerate() {
        if n >> k == 0 {
            break;
        }
        if (n >> k) & 1 == 1 {
            v = gf2_times(m, v);
        }
    }
    v
}

/// The 32×32 GF(2) matrix `m` (one column per bit) times the vector `v`.
fn gf2_times(m: &[u32; 32], mut v: u32) -> u32 {
    let mut sum = 0;
    let mut i = 0;
    while v != 0 {
        if v & 1 == 1 {
            sum ^= m[i];
        }
        v >>= 1;
        i += 1;
    }
    sum
}

/// The object's version if its bytes match its checksums, else [`SUSPECT`].
pub fn verify<F: ObjFile>(f: &mut F) -> io::Result<Version> {
    let Some(header) = read_header(f)? else { return Ok(SUSPECT) };
    let data_len = f.len()?.saturating_sub(HEADER_BYTES);
    if data_len.div_ceil(CRC_BLOCK_BYTES) as usize != header.crcs.len() {
        return Ok(SUSPECT);
    }
    for (b, want) in header.crcs.iter().enumerate() {
        if block_crc(f, b, data_len)? != *want {
            return Ok(SUSPECT);
        }
    }
    Ok(header.version)
}

/// Reads the object's bytes.
pub fn read_body<F: ObjFile>(f: &mut F) -> io::Result<Vec<u8>> {
    let len = f.len()?.saturating_sub(HEADER_BYTES);
    let mut buf = vec![0u8; len as usize];
    let got = f.read_at(&mut buf, HEADER_BYTES)?;
    buf.truncate(got);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object file in memory.
    #[derive(Default)]
    struct Mem(Vec<u8>);

    impl ObjFile for Mem {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            let o = (offset as usize).min(self.0.len());
            let n = buf.len().min(self.0.len() - o);
            buf[..n].copy_from_slice(&self.0[o..o + n]);
            Ok(n)
        }
        fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
            let end = offset as usize + data.len();
            if self.0.len() < end {
                self.0.resize(end, 0);
            }
            self.0[offset as usize..end].copy_from_slice(data);
            Ok(())
        }
        fn len(&mut self) -> io::Result<u64> {
            Ok(self.0.len() as u64)
        }
        fn set_len(&mut self, len: u64) -> io::Result<()> {
            self.0.resize(len as usize, 0);
            Ok(())
        }
        fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
            self.0[offset as usize..(offset + len) as usize].fill(0);
            Ok(())
        }
    }

    #[test]
    fn a_checksum_updated_from_the_overwritten_bytes_equals_one_computed_afresh() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let len = rng.gen_range(1..=70_000usize);
            let mut msg: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let at = rng.gen_range(0..len);
            let n = rng.gen_range(1..=(len - at).min(9000));
            let before = crc32c::crc32c(&msg);
            let old = msg[at..at + n].to_vec();
            let new: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            msg[at..at + n].copy_from_slice(&new);
            let after = (len - at - n) as u64;
            assert_eq!(crc_after_overwrite(before, &old, &new, after), crc32c::crc32c(&msg), "len {len} at {at} n {n}");
        }
    }

    #[test]
    fn small_writes_leave_the_same_header_as_a_full_recompute() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let v = |seq| Version { epoch: 1, seq };
        let mut f = Mem::default();
        apply(&mut f, v(1), &RepOp::Write { offset: 0, data: (0..200_000u32).map(|i| (i * 7) as u8).collect() }).unwrap();
        for seq in 2..200 {
            let len = f.len().unwrap() - HEADER_BYTES;
            let offset = rng.gen_range(0..len) as u32;
            let n = rng.gen_range(1..=((len - offset as u64).min(5000) as usize));
            let data: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            apply(&mut f, v(seq), &RepOp::Write { offset, data }).unwrap();
            assert_eq!(verify(&mut f).unwrap(), v(seq), "after a write of {n} at {offset}");
        }
        // A block that was damaged before a small write stays suspect after it.
        let at = (HEADER_BYTES + 70_000) as usize;
        f.0[at] ^= 0xff;
        apply(&mut f, v(300), &RepOp::Write { offset: 66_000, data: vec![1; 100] }).unwrap();
        assert_eq!(verify(&mut f).unwrap(), SUSPECT);
    }

    #[test]
    fn writes_keep_checksums_valid_and_damage_is_detected() {
        let mut f = Mem::default();
        let v = |seq| Version { epoch: 1, seq };
        apply(&mut f, v(1), &RepOp::Write { offset: 200_000, data: vec![7; 100] }).unwrap();
        assert_eq!(verify(&mut f).unwrap(), v(1));
        apply(&mut f, v(2), &RepOp::Write { offset: 10, data: vec![1; 70_000] }).unwrap();
        apply(&mut f, v(3), &RepOp::Zero { offset: 60_000, len: 5_000 }).unwrap();
        assert_eq!(verify(&mut f).unwrap(), v(3));
        let body = read_body(&mut f).unwrap();
        assert_eq!(body.len(), 200_100);
        assert_eq!(&body[59_999..60_001], &[1, 0]);
        assert_eq!(&body[64_999..65_001], &[0, 1]);
        // A lost data write under a kept header, and a kept data write under a lost header.
        let good = f.0.clone();
        f.0[HEADER_BYTES as usize + 5] ^= 1;
        assert_eq!(verify(&mut f).unwrap(), SUSPECT);
        f.0 = good.clone();
        let mut old_header = good[..HEADER_BYTES as usize].to_vec();
        apply(&mut f, v(4), &RepOp::Write { offset: 150_000, data: vec![9; 10] }).unwrap();
        f.0[..HEADER_BYTES as usize].copy_from_slice(&old_header);
        assert_eq!(verify(&mut f).unwrap(), SUSPECT);
        old_header[0] ^= 0xff;
        f.0[..HEADER_BYTES as usize].copy_from_slice(&old_header);
        assert_eq!(verify(&mut f).unwrap(), SUSPECT, "a damaged header is suspect");
        apply(&mut f, v(5), &RepOp::Put { data: vec![3; 5] }).unwrap();
        assert_eq!(verify(&mut f).unwrap(), v(5));
        assert_eq!(read_body(&mut f).unwrap(), vec![3; 5]);
    }

    #[test]
    fn growing_past_a_partial_last_block_rechecksums_it() {
        // The last block of a 100-byte object grows to a whole 64 KiB block (its new bytes are
        // zeroes) when a write lands two blocks further on: its checksum must be recomputed.
        let mut f = Mem::default();
        let v = |seq| Version { epoch: 1, seq };
        apply(&mut f, v(1), &RepOp::Write { offset: 0, data: vec![4; 100] }).unwrap();
        apply(&mut f, v(2), &RepOp::Write { offset: 200_000, data: vec![5; 10] }).unwrap();
        assert_eq!(verify(&mut f).unwrap(), v(2));
    }
}
