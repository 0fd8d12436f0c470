//! The backup's SSD log format as the core sees it (paper §3.2, §5.3; spec `ssdlog.rs`): a
//! writeback batch is a run of 4 KiB pages; each page (or, for an entry larger than a page, a
//! group of whole pages) holds `u32 LE payload length │ postcard Vec<Entry> │ zero padding`.
//! An entry never straddles a page boundary unless it is larger than a page, so a PriorityPull
//! reads exactly the page(s) its index names and gets the page's neighbours for free (M18).
//! Pages are written once (the log is append-only) and the driver syncs a batch before it
//! reports it written, so a page the index names is always whole.

use crate::witness::proto::Entry;

/// The unit of a PriorityPull read and of page packing.
pub const PAGE_BYTES: usize = 4096;
const LEN_PREFIX_BYTES: usize = 4;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PageError {
    #[error("page group of {0} bytes is not a whole number of {PAGE_BYTES}-byte pages")]
    NotWholePages(usize),
    #[error("page payload length {0} exceeds the page group ({1} bytes)")]
    BadLength(usize, usize),
    #[error("page payload does not decode: {0}")]
    Malformed(String),
}

/// Where an entry landed inside an encoded batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Byte offset of the entry's page group from the batch start (page aligned).
    pub off: u64,
    /// Length of the page group (a multiple of `PAGE_BYTES`).
    pub len: u32,
}

fn encode_group(entries: &[Entry]) -> Vec<u8> {
    let payload = postcard::to_allocvec(entries).expect("entries always serialise");
    let total = (LEN_PREFIX_BYTES + payload.len()).div_ceil(PAGE_BYTES) * PAGE_BYTES;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    out.resize(total, 0);
    out
}

/// Packs `entries` (in log order) into pages. Returns the bytes and, per entry, its page group.
pub fn encode_batch(entries: &[Entry]) -> (Vec<u8>, Vec<Placed>) {
    let mut out = Vec::new();
    let mut placed = Vec::with_capacity(entries.len());
    let mut start = 0;
    while start < entries.len() {
        // Grow the page while the encoding still fits one page; a lone oversized entry gets a
        // group of its own.
        let mut end = start + 1;
        while end < entries.len()
            && LEN_PREFIX_BYTES
                + postcard::to_allocvec(&entries[start..end + 1])
                    .expect("entries always serialise")
                    .len()
                <= PAGE_BYTES
        {
            end += 1;
        }
        let group = encode_group(&entries[start..end]);
        let off = out.len() as u64;
        for _ in start..end {
            placed.push(Placed {
                off,
                len: group.len() as u32,
            });
        }
        out.extend_from_slice(&group);
        start = end;
    }
    (out, placed)
}

/// Decodes one page group (as read at a `Placed` location).
pub fn decode_group(bytes: &[u8]) -> Result<Vec<Entry>, PageError> {
    if !bytes.len().is_multiple_of(PAGE_BYTES) || bytes.is_empty() {
        return Err(PageError::NotWholePages(bytes.len()));
    }
    let n = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
    if n + LEN_PREFIX_BYTES > bytes.len() {
        return Err(PageError::BadLength(n, bytes.len()));
    }
    postcard::from_bytes(&bytes[4..4 + n]).map_err(|e| PageError::Malformed(e.to_string()))
}

/// Decodes a run of page groups (a BatchPull read): every group in order. A zero length prefix
/// (a never-written page) ends the run.
pub fn decode_run(bytes: &[u8]) -> Result<Vec<Entry>, PageError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + PAGE_BYTES <= bytes.len() {
        let n = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if n == 0 {
            break;
        }
        let len = (LEN_PREFIX_BYTES + n).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        if at + len > bytes.len() {
            return Err(PageError::BadLength(n, bytes.len() - at));
        }
        out.extend(decode_group(&bytes[at..at + len])?);
        at += len;
    }
    Ok(out)
}

/// Bytes of the whole page groups at the start of `bytes` (where a BatchPull read that was cut
/// short must resume).
pub fn whole_groups_len(bytes: &[u8]) -> usize {
    let mut at = 0;
    while at + PAGE_BYTES <= bytes.len() {
        let n = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if n == 0 {
            break;
        }
        let len = (LEN_PREFIX_BYTES + n).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        if at + len > bytes.len() {
            break;
        }
        at += len;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::witness::proto::Op;

    fn put(i: u64, vlen: usize) -> Entry {
        Entry {
            index: i,
            term: 1,
            op: Op::Put {
                key: format!("k{i}").into_bytes(),
                value: Some(serde_bytes::ByteBuf::from(vec![i as u8; vlen])),
            },
        }
    }

    #[test]
    fn batch_round_trips_and_entries_share_pages() {
        let entries: Vec<Entry> = (1..=10).map(|i| put(i, 1000)).collect();
        let (bytes, placed) = encode_batch(&entries);
        assert_eq!(bytes.len() % PAGE_BYTES, 0);
        assert_eq!(decode_run(&bytes).unwrap(), entries);
        // 1 KiB values: several per page, none straddling.
        assert_eq!(placed[0], placed[1]);
        for (e, p) in entries.iter().zip(&placed) {
            let g = &bytes[p.off as usize..p.off as usize + p.len as usize];
            assert!(decode_group(g).unwrap().contains(e));
        }
    }

    #[test]
    fn oversized_entry_gets_whole_pages() {
        let entries = vec![put(1, 10), put(2, 9000), put(3, 10)];
        let (bytes, placed) = encode_batch(&entries);
        assert_eq!(placed[1].len as usize, 3 * PAGE_BYTES);
        assert_eq!(decode_run(&bytes).unwrap(), entries);
        assert_eq!(
            whole_groups_len(&bytes[..bytes.len() - 1]),
            placed[2].off as usize
        );
        assert!(decode_group(&bytes[..100]).is_err());
    }
}
