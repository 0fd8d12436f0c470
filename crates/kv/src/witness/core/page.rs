//! The backup's one SSD format (paper §3.2, §5.3; spec (c) "SSD tier"): what the core writes
//! back and reads, and what `store::ssdlog` scans at a restart. Sans-I/O.
//!
//! A log is a set of segments (ids unique across the hot and cold logs); a segment is a
//! sequence of 4 KiB pages. Each entry is framed `len: u32 LE | crc32c: u32 LE | payload`, with
//! payload `kind: u8 | key_len: u16 LE | key | term: u64 LE | index: u64 LE | value` (kind 0 =
//! Noop, 1 = Put with its value, 2 = a key-only Put). Why this shape:
//! - **The checksum covers the segment id and the entry's offset**, so a stale page (a segment
//!   freed and its file range reused, a misdirected read) never decodes as the entry the index
//!   names: position is part of identity.
//! - **An entry never straddles a page unless it is larger than a page**; such an entry starts
//!   on a page boundary and owns its last page. A PriorityPull reads exactly the page(s) its
//!   index names and gets the page's neighbours for free (M18).
//! - **A batch starts on a fresh page** and the rest of a page after its last entry is zero
//!   (`len` 0 = "next page"): a durable page is never rewritten, so a crash during a batch
//!   cannot damage an earlier, acknowledged one. Every transfer is whole, aligned pages, which
//!   is what `O_DIRECT` needs.
//!
//! A scan ([`decode_pages`]) stops at the first torn or corrupt entry or at a page that starts
//! empty; nothing behind a torn tail is trusted.

use crate::witness::proto::{Entry, Op, MAX_KEY_BYTES, MAX_VALUE_BYTES};

/// The unit of every SSD transfer and of entry packing.
pub const PAGE_BYTES: usize = 4096;
/// Bytes of an entry's frame (len, crc32c).
pub const FRAME_BYTES: usize = 8;
/// Bytes of an entry's payload besides key and value: kind, key length, term, index.
pub const ENTRY_FIXED_BYTES: usize = 1 + 2 + 8 + 8;
const MAX_PAYLOAD_BYTES: usize = ENTRY_FIXED_BYTES + MAX_KEY_BYTES + MAX_VALUE_BYTES;

const KIND_NOOP: u8 = 0;
const KIND_PUT: u8 = 1;
const KIND_PUT_KEY_ONLY: u8 = 2;
/// A configuration entry (M22–M24): the value is the postcard-encoded `Config`.
const KIND_CONFIG: u8 = 3;
/// A Put with its value written by a refill (`core/refill.rs`): a version of the key at its
/// stamp, not a log entry. A restart indexes it but never counts its index as part of the
/// backup's log, so a refill cut short by a crash never passes for a log the backup holds.
const KIND_REFILL_PUT: u8 = 4;

/// The bytes a configuration entry's value holds on SSD.
fn config_bytes(cfg: &crate::witness::proto::Config) -> Vec<u8> {
    postcard::to_allocvec(cfg).expect("a configuration always serialises")
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PageError {
    #[error("entry with a {key} B key and a {value} B value exceeds the limits ({MAX_KEY_BYTES} B key, {MAX_VALUE_BYTES} B value)")]
    EntryTooLarge { key: usize, value: usize },
}

/// Where an entry is: its segment, the byte offset of its frame, the frame's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    pub seg: u64,
    pub off: u64,
    pub len: u32,
}

impl Loc {
    /// The page-aligned byte range holding the entry: (offset, length).
    pub fn page_span(&self) -> (u64, usize) {
        let start = self.off / PAGE_BYTES as u64 * PAGE_BYTES as u64;
        let end = (self.off + self.len as u64).div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        (start, (end - start) as usize)
    }
}

fn entry_crc(seg: u64, off: u64, payload: &[u8]) -> u32 {
    let c = crc32c::crc32c(&seg.to_le_bytes());
    let c = crc32c::crc32c_append(c, &off.to_le_bytes());
    crc32c::crc32c_append(c, payload)
}

pub fn round_up_page(n: usize) -> usize {
    n.div_ceil(PAGE_BYTES) * PAGE_BYTES
}

/// The framed size of an entry.
pub fn framed_len(e: &Entry) -> usize {
    let value = match &e.op {
        Op::Config(cfg) => config_bytes(cfg).len(),
        _ => e.value().map_or(0, <[u8]>::len),
    };
    FRAME_BYTES + ENTRY_FIXED_BYTES + e.key().map_or(0, <[u8]>::len) + value
}

/// Where an entry of `framed` bytes goes when the batch holds `pos` bytes: here, or on the
/// next page if it would straddle one (or is larger than a page).
fn place_at(pos: usize, framed: usize) -> usize {
    let in_page = pos % PAGE_BYTES;
    if in_page != 0 && (framed > PAGE_BYTES || PAGE_BYTES - in_page < framed) {
        round_up_page(pos)
    } else {
        pos
    }
}

fn advance(pos: usize, framed: usize) -> usize {
    let end = place_at(pos, framed) + framed;
    if framed > PAGE_BYTES {
        round_up_page(end)
    } else {
        end
    }
}

/// The bytes (whole pages) `entries` take as one batch.
pub fn packed_len<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> usize {
    round_up_page(
        entries
            .into_iter()
            .fold(0, |pos, e| advance(pos, framed_len(e))),
    )
}

/// Packs entries into pages for one batch that will be written at byte `base` of segment
/// `seg` (both known before packing, because the checksum covers them).
pub struct BatchBuilder {
    seg: u64,
    base: u64,
    buf: Vec<u8>,
    locs: Vec<Loc>,
}

impl BatchBuilder {
    pub fn new(seg: u64, base: u64) -> Self {
        assert_eq!(base % PAGE_BYTES as u64, 0, "batches start on a page");
        BatchBuilder {
            seg,
            base,
            buf: Vec::new(),
            locs: Vec::new(),
        }
    }

    /// Bytes the batch would take (whole pages) with one more entry `e`.
    pub fn len_with(&self, e: &Entry) -> usize {
        round_up_page(advance(self.buf.len(), framed_len(e)))
    }

    /// Bytes the batch takes now (whole pages).
    pub fn len_bytes(&self) -> usize {
        round_up_page(self.buf.len())
    }

    pub fn is_empty(&self) -> bool {
        self.locs.is_empty()
    }

    pub fn push(&mut self, e: &Entry) -> Result<Loc, PageError> {
        self.push_tagged(e, false)
    }

    /// [`Self::push`], with `refill` marking a Put (with its value) as a refill version.
    pub fn push_tagged(&mut self, e: &Entry, refill: bool) -> Result<Loc, PageError> {
        let cfg_bytes;
        let (kind, key, value): (u8, &[u8], &[u8]) = match &e.op {
            Op::Noop => (KIND_NOOP, &[], &[]),
            Op::Config(cfg) => {
                cfg_bytes = config_bytes(cfg);
                (KIND_CONFIG, &[], &cfg_bytes)
            }
            Op::Put {
                key,
                value: Some(v),
            } => (if refill { KIND_REFILL_PUT } else { KIND_PUT }, key, v),
            Op::Put { key, value: None } => (KIND_PUT_KEY_ONLY, key, &[]),
        };
        if key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
            return Err(PageError::EntryTooLarge {
                key: key.len(),
                value: value.len(),
            });
        }
        let framed = framed_len(e);
        let at = place_at(self.buf.len(), framed);
        self.buf.resize(at, 0);
        let off = self.base + at as u64;
        let mut payload = Vec::with_capacity(framed - FRAME_BYTES);
        payload.push(kind);
        payload.extend_from_slice(&(key.len() as u16).to_le_bytes());
        payload.extend_from_slice(key);
        payload.extend_from_slice(&e.term.to_le_bytes());
        payload.extend_from_slice(&e.index.to_le_bytes());
        payload.extend_from_slice(value);
        self.buf
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.buf
            .extend_from_slice(&entry_crc(self.seg, off, &payload).to_le_bytes());
        self.buf.extend_from_slice(&payload);
        if framed > PAGE_BYTES {
            // A large entry owns its last page too: the next entry starts on a fresh page.
            self.buf.resize(round_up_page(self.buf.len()), 0);
        }
        let loc = Loc {
            seg: self.seg,
            off,
            len: framed as u32,
        };
        self.locs.push(loc);
        Ok(loc)
    }

    /// The batch's pages (whole pages, zero padded) and each pushed entry's location, in order.
    pub fn finish(mut self) -> (Vec<u8>, Vec<Loc>) {
        let n = self.len_bytes();
        self.buf.resize(n, 0);
        (self.buf, self.locs)
    }
}

/// The entry and whether it is a refill version.
fn decode_payload(p: &[u8]) -> Option<(Entry, bool)> {
    let (&kind, rest) = p.split_first()?;
    let klen = u16::from_le_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    if klen > MAX_KEY_BYTES || rest.len() < 2 + klen + 16 {
        return None;
    }
    let key = &rest[2..2 + klen];
    let f = &rest[2 + klen..];
    let term = u64::from_le_bytes(f[0..8].try_into().ok()?);
    let index = u64::from_le_bytes(f[8..16].try_into().ok()?);
    let value = &f[16..];
    let op = match kind {
        KIND_NOOP if klen == 0 && value.is_empty() => Op::Noop,
        KIND_PUT | KIND_REFILL_PUT => Op::Put {
            key: key.to_vec(),
            value: Some(serde_bytes::ByteBuf::from(value.to_vec())),
        },
        KIND_PUT_KEY_ONLY if value.is_empty() => Op::Put {
            key: key.to_vec(),
            value: None,
        },
        KIND_CONFIG if klen == 0 => Op::Config(postcard::from_bytes(value).ok()?),
        _ => return None,
    };
    Some((Entry { index, term, op }, kind == KIND_REFILL_PUT))
}

/// Decodes the entries of `bytes`, which start at page-aligned byte `base` of segment `seg`.
/// Stops at the first torn or corrupt entry or at a page that starts empty. Returns the entries
/// with their locations and the byte (relative to `base`, a page multiple) where valid data ends.
/// A large entry cut off by the end of `bytes` also ends the scan (read more to get it; its
/// length is [`cut_off_len`]).
pub fn decode_pages(seg: u64, base: u64, bytes: &[u8]) -> (Vec<(Loc, Entry)>, usize) {
    let (es, valid) = decode_pages_tagged(seg, base, bytes);
    (es.into_iter().map(|(l, e, _)| (l, e)).collect(), valid)
}

/// [`decode_pages`] telling refill versions apart (`true`): what a restart and GC need.
pub fn decode_pages_tagged(seg: u64, base: u64, bytes: &[u8]) -> (Vec<(Loc, Entry, bool)>, usize) {
    let mut out = Vec::new();
    let mut pos = 0usize;
    loop {
        let in_page = pos % PAGE_BYTES;
        if in_page != 0 && PAGE_BYTES - in_page < FRAME_BYTES {
            pos = round_up_page(pos);
        }
        if pos + FRAME_BYTES > bytes.len() {
            break;
        }
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if len == 0 {
            if pos.is_multiple_of(PAGE_BYTES) {
                break;
            }
            pos = round_up_page(pos);
            continue;
        }
        let framed = FRAME_BYTES + len;
        if !(ENTRY_FIXED_BYTES..=MAX_PAYLOAD_BYTES).contains(&len) || pos + framed > bytes.len() {
            break;
        }
        if framed <= PAGE_BYTES && pos % PAGE_BYTES + framed > PAGE_BYTES {
            break;
        }
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap());
        let payload = &bytes[pos + FRAME_BYTES..pos + framed];
        let off = base + pos as u64;
        if entry_crc(seg, off, payload) != crc {
            break;
        }
        let Some((e, refill)) = decode_payload(payload) else {
            break;
        };
        out.push((
            Loc {
                seg,
                off,
                len: framed as u32,
            },
            e,
            refill,
        ));
        pos = advance(pos, framed);
    }
    (out, round_up_page(pos).min(round_up_page(bytes.len())))
}

/// The whole pages a read at a page boundary must cover to hold the entry whose frame starts
/// there, if that entry is larger than `bytes` (a BatchPull read cut a large entry short).
pub fn cut_off_len(bytes: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let framed = FRAME_BYTES + len;
    ((ENTRY_FIXED_BYTES..=MAX_PAYLOAD_BYTES).contains(&len) && framed > bytes.len())
        .then(|| round_up_page(framed))
}

/// The entry at exactly `loc` in `bytes`, the pages `loc.page_span()` names.
pub fn entry_at(loc: Loc, bytes: &[u8]) -> Option<Entry> {
    let (start, _) = loc.page_span();
    let (es, _) = decode_pages(loc.seg, start, bytes);
    es.into_iter().find(|(l, _)| *l == loc).map(|(_, e)| e)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_refill_version_keeps_its_tag_and_reads_as_a_put() {
        let mut b = BatchBuilder::new(3, 0);
        let (log, refill) = (put(5, 10), put(6, 10));
        b.push(&log).unwrap();
        b.push_tagged(&refill, true).unwrap();
        // A Noop has no value: the tag cannot apply and is ignored.
        b.push_tagged(&Entry { index: 7, term: 1, op: Op::Noop }, true).unwrap();
        let (bytes, _) = b.finish();
        let got: Vec<(Entry, bool)> = decode_pages_tagged(3, 0, &bytes)
            .0
            .into_iter()
            .map(|(_, e, t)| (e, t))
            .collect();
        assert_eq!(got[0], (log, false));
        assert_eq!(got[1], (refill.clone(), true));
        assert!(!got[2].1);
        assert_eq!(decode_pages(3, 0, &bytes).0[1].1, refill);
    }

    #[test]
    fn page_packing_never_straddles_a_page_unless_larger_and_round_trips() {
        let mut b = BatchBuilder::new(7, 8192);
        let mut es: Vec<Entry> = [1000, 1000, 1000, 1000, 5000, 10, 3000, 3000]
            .iter()
            .enumerate()
            .map(|(i, v)| put(i as u64 + 1, *v))
            .collect();
        es.push(Entry {
            index: 20,
            term: 2,
            op: Op::Noop,
        });
        es.push(put(21, 0).key_only());
        let locs: Vec<Loc> = es.iter().map(|e| b.push(e).unwrap()).collect();
        for l in &locs {
            let first = l.off / PAGE_BYTES as u64;
            let last = (l.off + l.len as u64 - 1) / PAGE_BYTES as u64;
            if l.len as usize <= PAGE_BYTES {
                assert_eq!(first, last, "{l:?}");
            } else {
                assert_eq!(l.off % PAGE_BYTES as u64, 0, "{l:?}");
            }
        }
        // The fourth 1000 B value does not fit in page 0 with the first three.
        assert_eq!(locs[3].off, 8192 + 4096);
        let (buf, got) = b.finish();
        assert_eq!(got, locs);
        assert_eq!(buf.len(), packed_len(&es));
        assert_eq!(buf.len() % PAGE_BYTES, 0);
        let (dec, valid) = decode_pages(7, 8192, &buf);
        assert_eq!(valid, buf.len());
        assert_eq!(dec.iter().map(|d| d.0).collect::<Vec<_>>(), locs);
        assert_eq!(dec.into_iter().map(|d| d.1).collect::<Vec<_>>(), es);
        // One entry by its location, from the pages it names.
        let (s, n) = locs[4].page_span();
        let pages = &buf[(s - 8192) as usize..(s - 8192) as usize + n];
        assert_eq!(entry_at(locs[4], pages), Some(es[4].clone()));
        // A read cut short inside the large entry says how much to read.
        assert_eq!(cut_off_len(&pages[..PAGE_BYTES]), Some(2 * PAGE_BYTES));
        assert_eq!(decode_pages(7, s, &pages[..PAGE_BYTES]).0.len(), 0);
        // The checksum binds an entry to its place: the same bytes elsewhere do not decode.
        assert!(decode_pages(8, 8192, &buf).0.is_empty());
        assert!(decode_pages(7, 0, &buf).0.is_empty());
        assert!(entry_at(
            Loc {
                off: locs[0].off + 4096,
                ..locs[0]
            },
            &buf[..4096]
        )
        .is_none());
    }

    #[test]
    fn page_scan_stops_at_torn_or_corrupt_entries() {
        let mut b = BatchBuilder::new(1, 0);
        let es: Vec<Entry> = (1..=6).map(|i| put(i, 900)).collect();
        let locs: Vec<Loc> = es.iter().map(|e| b.push(e).unwrap()).collect();
        let (mut buf, _) = b.finish();
        // Flip one byte in the fourth entry's value: the first three survive.
        buf[locs[3].off as usize + 40] ^= 1;
        let (dec, valid) = decode_pages(1, 0, &buf);
        assert_eq!(dec.len(), 3);
        assert_eq!(valid, PAGE_BYTES);
        // Garbage lengths never panic.
        let junk = vec![0xffu8; PAGE_BYTES];
        assert!(decode_pages(1, 0, &junk).0.is_empty());
        assert!(matches!(
            BatchBuilder::new(1, 0).push(&put(1, MAX_VALUE_BYTES + 1)),
            Err(PageError::EntryTooLarge { .. })
        ));
    }
}
