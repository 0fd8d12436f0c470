//! Wire messages between clients, log peers and the controller (postcard inside `wire` frames).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A log file's cluster-wide id, given by the controller.
pub type FileId = u64;
/// A log peer's id, given by the controller when the peer first registers.
pub type PeerId = u32;
/// A file's epoch: bumped by the controller at every open, so the newest opener fences the
/// older ones (a peer refuses records of an epoch below the highest it was probed with).
pub type Epoch = u64;

/// The epoch of a *reader* (a read-only open): `Probe`, `Fetch` and `Sums` at this epoch
/// promise nothing and are never refused as stale, so verifying a local copy never fences a
/// live writer. The controller hands out epochs from 1.
pub const READ_EPOCH: Epoch = 0;

/// Bytes per checksummed block of a peer's copy of a file. A peer keeps one CRC32C per block, so
/// a replica corrupted at rest is detected when it is read back for recovery.
pub const BLOCK_BYTES: usize = 4096;
/// Largest data chunk in one message (writes are split, fetches answer at most this much).
pub const MAX_CHUNK_BYTES: usize = 1024 * 1024;
/// Largest frame any nearlog endpoint accepts.
pub const MAX_FRAME_BYTES: usize = MAX_CHUNK_BYTES + 64 * 1024;

/// One replicated operation of a file, applied by peers in `seq` order within an epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// First op of every epoch. `from = Some((e, s))`: keep your committed copy, which must be
    /// exactly the state (e, s); `from = None`: commit the staged image sent with [`PeerRequest::Stage`].
    /// `size` and `image_crc` describe the image either way (checked by the peer).
    Base { from: Option<(Epoch, u64)>, size: u64, image_crc: u32 },
    /// Bytes at an offset; `crc` is CRC32C of `data`, checked by the peer before applying.
    Write {
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        crc: u32,
    },
    /// The file's size becomes `size` (shrink or zero-extend): replicated, so trailing zeros and
    /// truncation survive recovery.
    Truncate { size: u64 },
}

impl Op {
    pub fn write(offset: u64, data: Vec<u8>) -> Op {
        let crc = crc32c::crc32c(&data);
        Op::Write { offset, data, crc }
    }

    /// Bytes this op holds (for the client's bounded retransmit buffer).
    pub fn payload_bytes(&self) -> usize {
        match self {
            Op::Write { data, .. } => data.len(),
            _ => 0,
        }
    }
}

/// Client -> log peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Promise to refuse anything below `epoch` for `file`, and say what you hold.
    Probe { file: FileId, epoch: Epoch },
    /// Read back committed bytes `offset..offset+len` (offset block-aligned, len ≤ MAX_CHUNK_BYTES).
    Fetch { file: FileId, epoch: Epoch, offset: u64, len: u32 },
    /// Part of a full image for a `Base { from: None }` at (`epoch`, `seq`) (idempotent by
    /// offset; ignored by a peer whose copy is already at or past that state). `supersede`: the client knows a majority holds complete copies of every acknowledged op
    /// without this peer, so if the image does not fit beside this peer's committed copy, the
    /// peer may release that copy first (it stops being a witness until the Base commits).
    Stage {
        file: FileId,
        epoch: Epoch,
        seq: u64,
        size: u64,
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        supersede: bool,
    },
    /// One replicated record: the file's epoch, its position in the epoch's op stream, the op.
    Record { file: FileId, epoch: Epoch, seq: u64, op: Op },
    /// Forget the file (unlink, or rename over it); frees its region bytes.
    Drop { file: FileId, epoch: Epoch },
    /// Liveness and space check.
    Stats,
    /// The block checksums of committed bytes `offset..offset+len` (offset block-aligned, len ≤
    /// [`MAX_SUMS_BYTES`]), without the bytes: a client with a local copy fetches only the
    /// blocks whose checksums differ from it.
    Sums { file: FileId, epoch: Epoch, offset: u64, len: u64 },
    /// Starts the staged image for a `Base { from: None }` at (`epoch`, `seq`) from this peer's
    /// committed copy, cut or zero-extended to `size`: the `Stage` chunks that follow carry only
    /// the blocks where the image differs from it (the client compared the copy's `Sums`), so a
    /// peer that lags behind is patched instead of sent the whole image. The Base's `image_crc`
    /// still checks the result (a mismatch answers `NeedImage`: the client sends it whole).
    /// Answered `Staged`, or `NoCopy` without a committed copy.
    StageCopy { file: FileId, epoch: Epoch, seq: u64, size: u64 },
}

/// Largest range one [`PeerRequest::Sums`] covers (a multiple of `MAX_CHUNK_BYTES`; its reply
/// holds one CRC32C per `BLOCK_BYTES`: at most 64 Ki checksums, well inside a frame).
pub const MAX_SUMS_BYTES: u64 = 256 * 1024 * 1024;

/// What a peer holds of a file, as answered to a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    pub epoch: Epoch,
    pub seq: u64,
    pub size: u64,
}

/// Log peer -> client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerReply {
    /// Answer to a probe: `None` if this peer holds no committed copy (never had one, dropped,
    /// or restarted and lost its memory: such a peer never counts as a witness).
    Probed { file: FileId, epoch: Epoch, holding: Option<Holding> },
    /// Fetched bytes and the CRC32C of each `BLOCK_BYTES` block they cover (last may be partial).
    Data {
        file: FileId,
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        block_crcs: Vec<u32>,
        holding: Holding,
    },
    /// Stage chunk stored.
    Staged { file: FileId, epoch: Epoch, offset: u64 },
    /// Cumulative: the peer's committed copy is at (epoch, applied_seq). An ack of an older epoch
    /// means the peer has not applied this epoch's Base yet.
    Ack { file: FileId, epoch: Epoch, applied_seq: u64 },
    /// The Base could not be applied (state moved, or the staged image is incomplete/mismatched):
    /// send the full image.
    NeedImage { file: FileId, epoch: Epoch },
    /// A newer epoch has probed this file: this writer is fenced.
    Stale { file: FileId, promised: Epoch },
    /// The lent region cannot hold this op: the client must fail loudly (never a short write).
    RegionFull { file: FileId, epoch: Epoch, region_bytes: u64, used_bytes: u64 },
    /// A malformed request (bad checksum in a record, out-of-range fetch).
    Refused { file: FileId, reason: String },
    Dropped { file: FileId },
    Stats { region_bytes: u64, used_bytes: u64, files: u64 },
    /// Answer to [`PeerRequest::Sums`]: the CRC32C of each block from `offset` (last may be partial).
    Sums { file: FileId, offset: u64, block_crcs: Vec<u32>, holding: Holding },
    /// Answer to `Fetch`, `Sums` or `StageCopy` of a file this peer holds no committed copy of
    /// (never had one, dropped it, or restarted): no witness, nothing to patch.
    NoCopy { file: FileId, epoch: Epoch },
}

impl PeerReply {
    pub fn file(&self) -> Option<FileId> {
        match self {
            PeerReply::Probed { file, .. }
            | PeerReply::Data { file, .. }
            | PeerReply::Staged { file, .. }
            | PeerReply::Ack { file, .. }
            | PeerReply::NeedImage { file, .. }
            | PeerReply::Stale { file, .. }
            | PeerReply::RegionFull { file, .. }
            | PeerReply::Refused { file, .. }
            | PeerReply::Dropped { file }
            | PeerReply::Sums { file, .. }
            | PeerReply::NoCopy { file, .. } => Some(*file),
            PeerReply::Stats { .. } => None,
        }
    }
}

/// Anyone -> controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CtlRequest {
    /// A peer announces itself. `known_as`: the id it was given before (kept in its identity
    /// file): the same peer restarted, memory lost, maybe at another address; the controller
    /// keeps that id (and the files placed on it) instead of registering a new peer. Without
    /// it, the same `addr` again is taken as the same peer restarted.
    RegisterPeer { addr: String, region_bytes: u64, known_as: Option<PeerId> },
    /// A peer's periodic report of the bytes and files it holds; answered with
    /// [`CtlReply::Heartbeat`] (files to release, whether the peer is being reclaimed).
    PeerHeartbeat { peer: PeerId, used_bytes: u64, files: Vec<FileId> },
    /// A client opens a log file by key: placement on first open, a new epoch every time.
    Open { key: String, replicas: u32 },
    /// The client committed the epoch's Base on a majority of the grant's peers: the file now
    /// has replicated content that a later open must recover (before that, an open may start
    /// from empty), and a pending move is complete (recovery no longer needs the old peers).
    Initialized { key: String, epoch: Epoch },
    /// Take a peer's memory back: every file on it is placed on another peer (the old set stays
    /// the recovery set until a client commits a Base on the new one); the peer gets no new
    /// files. Answers [`CtlReply::Reclaiming`] with the files still to move (idempotent).
    Reclaim { peer: PeerId },
    /// A mover's open of a file with a pending move: a new epoch over the new set, without
    /// taking over ownership (the application writer resumes after being fenced by it).
    Move { key: String },
    /// The writer that opened at (or last resumed at) `epoch` was fenced: if no other
    /// application opened the file since, it gets a new epoch over the current placement.
    Resume { key: String, epoch: Epoch },
    /// The writer at `epoch` met a full region on `full`: the file grows onto another peer
    /// with room (new epoch, old set as recovery set), or the answer is an error (ENOSPC).
    Relocate { key: String, epoch: Epoch, full: PeerId },
    /// Unlink: forget the file; the answer names its peers so the client frees their memory.
    Remove { key: String },
    /// Rename: the file keeps its id and peers under a new key; a file that lived at `to` is
    /// forgotten and returned so its peers are freed.
    Rename { from: String, to: String },
    /// Peers, their space, and the files.
    Status,
    /// Where `key` lives, without a new epoch (a reader verifying its local copy must not
    /// fence the writer): answered [`CtlReply::Found`].
    Lookup { key: String },
    /// The operator accepts the local copy of `key` as its content (its peers lost it, see
    /// `client::Failure::Lost`): the file is placed on live peers (those that registered or
    /// heartbeated since the controller started; its current ones where they are live), gets a
    /// new epoch (fencing every older writer and reader state) and is marked not initialized,
    /// so the opener this grant goes to bases the epoch on its local copy. Answered `Granted`.
    Reseed { key: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerAddr {
    pub id: PeerId,
    pub addr: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileGrant {
    pub key: String,
    pub file: FileId,
    pub epoch: Epoch,
    pub peers: Vec<PeerAddr>,
    /// False until some client committed a Base on a majority: then empty is the right content.
    pub initialized: bool,
    /// While a move is pending: the peers a majority of which must witness the recovery (the
    /// set the last committed epoch ran on). Empty: the same as `peers`.
    pub recover_from: Vec<PeerAddr>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CtlReply {
    Registered { peer: PeerId },
    Ok,
    /// Answer to a heartbeat: files the peer may free (no placement names it for them any
    /// more), and whether it is being reclaimed (it returns its region once empty).
    Heartbeat { release: Vec<FileId>, draining: bool },
    /// Answer to `Reclaim`: keys of the files whose move is not complete yet.
    Reclaiming { pending: Vec<String> },
    Granted(FileGrant),
    /// Remove/Rename: the forgotten file, if any (its peers should be told to drop it).
    Forgotten(Option<FileGrant>),
    Status(ControllerState),
    /// Answer to `Lookup`: the file's placement at its current epoch, or `None` (never replicated).
    Found(Option<FileGrant>),
    Error(String),
}

// The controller's state: what it persists (through `store::MetaStore`) and what `Status`
// answers. Here, not in `core::controller`, so that the messages depend on no core.

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub addr: String,
    pub region_bytes: u64,
    pub used_bytes: u64,
    /// Being reclaimed: no new placements; its files move to other peers.
    #[serde(default)]
    pub draining: bool,
    /// Registered or heartbeated since this controller started (soft state: cleared when the
    /// state is loaded): placements prefer live peers, and a re-seed uses only live ones.
    #[serde(default)]
    pub live: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub file: FileId,
    pub epoch: Epoch,
    pub peers: Vec<PeerId>,
    pub initialized: bool,
    /// A pending move (reclaim or full region): the set the last committed epoch ran on, whose
    /// majority must witness recovery until a Base commits on `peers`. Empty: no move pending.
    #[serde(default)]
    pub prev_peers: Vec<PeerId>,
    /// The epoch `peers` was last changed at: only a Base of a later epoch (granted with this
    /// set) completes the move.
    #[serde(default)]
    pub placed_at: Epoch,
    /// The epoch of the application writer (last `Open`, `Resume` or `Relocate`); a mover's
    /// epoch does not change it, so the writer it fenced may resume.
    #[serde(default)]
    pub owner_epoch: Epoch,
}

/// Everything the controller knows; persisted whole (it is small: a few bytes per file).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerState {
    pub peers: BTreeMap<PeerId, PeerInfo>,
    pub files: BTreeMap<String, FileMeta>,
    pub next_peer: PeerId,
    pub next_file: FileId,
}

/// Applies `op` to a file image (what a peer's copy and the local file go through).
pub fn apply_op(image: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data, .. } => {
            let end = *offset as usize + data.len();
            if image.len() < end {
                image.resize(end, 0);
            }
            image[*offset as usize..end].copy_from_slice(data);
        }
        Op::Truncate { size } => image.resize(*size as usize, 0),
        Op::Base { .. } => {}
    }
}
