//! What the persistent-memory log stores and catch-up ships: a record version (a key, its
//! Lamport timestamp, its value and its committed flag) and [`Chunk`], a packed run of them.
//! These belong to the log, the lowest layer of the KV; the protocols' messages
//! (`leaderless::proto`) carry them and import them from here, never the other way round.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A replica's id; dense from 0 within a replication group.
pub type NodeId = u32;

/// Largest key accepted from a client.
pub const MAX_KEY_BYTES: usize = 1024;
/// Largest value accepted from a client.
pub const MAX_VALUE_BYTES: usize = 1024 * 1024;

/// Lamport timestamp of a record (§II-B): higher version is newer, ties broken by node id.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Ts {
    pub version: u64,
    pub node: NodeId,
}

impl fmt::Display for Ts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{},{}>", self.version, self.node)
    }
}

/// A record version (what a [`Chunk`] holds, owned).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    pub ts: Ts,
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
    /// Committed (valid) at the sender; an uncommitted entry is installed invalid and replayed.
    pub committed: bool,
}

impl Entry {
    pub fn size_bytes(&self) -> usize {
        self.key.len() + self.value.len() + 24
    }
}

/// A record version borrowed from a [`Chunk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRef<'a> {
    pub key: &'a [u8],
    pub ts: Ts,
    pub value: &'a [u8],
    pub committed: bool,
}

impl EntryRef<'_> {
    pub fn to_entry(&self) -> Entry {
        Entry {
            key: self.key.to_vec(),
            ts: self.ts,
            value: self.value.to_vec(),
            committed: self.committed,
        }
    }
}

/// Bytes of a [`Chunk`] entry's fixed fields: key length, version, node, flags, value length.
pub const CHUNK_ENTRY_HEADER_BYTES: usize = 2 + 8 + 4 + 1 + 4;

/// The entries of one CatchUp_resp packed into one byte string, so a chunk is built with one
/// allocation (a store lookup and a copy per entry), travels as one frame with one checksum,
/// and is applied and logged from borrowed slices (no allocation per entry on either side).
/// Per entry: `key_len: u16 LE | key | version: u64 LE | node: u32 LE | flags: u8 (bit 0:
/// committed) | value_len: u32 LE | value`.
///
/// A received chunk may keep the whole frame it arrived in ([`Chunk::in_frame`]): its entries
/// are `buf[start..]`, taken from the socket's read buffer without a copy.
#[derive(Clone, Default)]
pub struct Chunk {
    buf: Vec<u8>,
    start: usize,
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Chunk").field(&self.bytes()).finish()
    }
}

impl PartialEq for Chunk {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for Chunk {}

impl std::hash::Hash for Chunk {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.bytes().hash(h)
    }
}

impl Serialize for Chunk {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.bytes())
    }
}

impl<'de> Deserialize<'de> for Chunk {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let buf = serde_bytes::ByteBuf::deserialize(d)?.into_vec();
        Ok(Chunk { buf, start: 0 })
    }
}

/// A malformed [`Chunk`] (from a peer: the chunk is dropped whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed catch-up chunk at byte {at}: {what}")]
pub struct ChunkError {
    pub at: usize,
    pub what: &'static str,
}

impl Chunk {
    pub fn with_capacity(bytes: usize) -> Self {
        Chunk {
            buf: Vec::with_capacity(bytes),
            start: 0,
        }
    }

    /// The chunk whose entries are `frame[start..end]`, keeping the frame's buffer.
    pub fn in_frame(mut frame: Vec<u8>, start: usize, end: usize) -> Self {
        assert!(
            start <= end && end <= frame.len(),
            "a chunk lies within its frame"
        );
        frame.truncate(end);
        if frame.capacity() > 2 * end + 4096 {
            // A buffer grown by an earlier, larger frame: not held for as long as the chunk.
            frame.shrink_to_fit();
        }
        Chunk { buf: frame, start }
    }

    /// The entries' bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    pub fn from_entries<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> Self {
        let mut c = Chunk::default();
        for e in entries {
            c.push(&e.key, e.ts, &e.value, e.committed);
        }
        c
    }

    /// Appends an entry. Keys and values are bounded by [`MAX_KEY_BYTES`] and
    /// [`MAX_VALUE_BYTES`] everywhere they enter a node, so their lengths fit the fields.
    pub fn push(&mut self, key: &[u8], ts: Ts, value: &[u8], committed: bool) {
        debug_assert!(key.len() <= u16::MAX as usize && value.len() <= u32::MAX as usize);
        let b = &mut self.buf;
        b.reserve(CHUNK_ENTRY_HEADER_BYTES + key.len() + value.len());
        b.extend_from_slice(&(key.len() as u16).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&ts.version.to_le_bytes());
        b.extend_from_slice(&ts.node.to_le_bytes());
        b.push(committed as u8);
        b.extend_from_slice(&(value.len() as u32).to_le_bytes());
        b.extend_from_slice(value);
    }

    pub fn len_bytes(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The entry at byte `at` and where the next starts.
    pub fn entry_at(&self, at: usize) -> Result<(EntryRef<'_>, usize), ChunkError> {
        let b = self.bytes();
        let err = |what| ChunkError { at, what };
        let take = |pos: usize, n: usize| -> Result<&[u8], ChunkError> {
            b.get(pos..pos.checked_add(n).ok_or(err("length overflow"))?)
                .ok_or(err("truncated entry"))
        };
        let klen = u16::from_le_bytes(take(at, 2)?.try_into().unwrap()) as usize;
        let key = take(at + 2, klen)?;
        let mut pos = at + 2 + klen;
        let f = take(pos, 8 + 4 + 1 + 4)?;
        let version = u64::from_le_bytes(f[0..8].try_into().unwrap());
        let node = u32::from_le_bytes(f[8..12].try_into().unwrap());
        let flags = f[12];
        let vlen = u32::from_le_bytes(f[13..17].try_into().unwrap()) as usize;
        pos += 17;
        if flags > 1 {
            return Err(err("unknown flags"));
        }
        if key.is_empty() || key.len() > MAX_KEY_BYTES || vlen > MAX_VALUE_BYTES {
            return Err(err("key or value out of bounds"));
        }
        let value = take(pos, vlen)?;
        Ok((
            EntryRef {
                key,
                ts: Ts { version, node },
                value,
                committed: flags == 1,
            },
            pos + vlen,
        ))
    }

    /// Sets the committed flag of the entry at byte `at`, an offset [`Chunk::push`] or
    /// [`Chunk::iter`] gave (anything else is a bug: panics).
    pub fn set_committed(&mut self, at: usize) {
        let (e, _) = self.entry_at(at).expect("an entry's offset");
        let flags = self.start + at + 2 + e.key.len() + 8 + 4;
        self.buf[flags] = 1;
    }

    /// Checks every entry; returns how many there are.
    pub fn validate(&self) -> Result<usize, ChunkError> {
        let (mut at, mut n) = (0, 0);
        while at < self.len_bytes() {
            at = self.entry_at(at)?.1;
            n += 1;
        }
        Ok(n)
    }

    /// The entries with their byte offsets, stopping at the first malformed one.
    pub fn iter(&self) -> impl Iterator<Item = Result<(usize, EntryRef<'_>), ChunkError>> + '_ {
        let mut at = 0;
        let mut failed = false;
        std::iter::from_fn(move || {
            if failed || at >= self.len_bytes() {
                return None;
            }
            match self.entry_at(at) {
                Ok((e, next)) => {
                    let here = at;
                    at = next;
                    Some(Ok((here, e)))
                }
                Err(e) => {
                    failed = true;
                    Some(Err(e))
                }
            }
        })
    }

    pub fn to_entries(&self) -> Result<Vec<Entry>, ChunkError> {
        self.iter().map(|r| r.map(|(_, e)| e.to_entry())).collect()
    }
}
