//! The on-disk format of one object, shared by the real and the simulated store.
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
