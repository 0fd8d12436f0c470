//! [`FileClient`]: the client side of one open log file (sans-I/O): recovery from a majority of
//! log peers, then ordered replication of writes and truncates with majority acknowledgement.
//!
//! Recovery (at every open, under a fresh epoch from the controller):
//! 1. **Probe** every peer: each promises to refuse older epochs and says what it holds
//!    (`(epoch, seq, size)` of its committed copy, or nothing).
//! 2. Once a majority of peers that *hold* a copy answered, the most advanced of them (highest
//!    epoch, then longest op prefix) is the source: any write acknowledged in an earlier epoch
//!    is on a majority, which intersects ours, and within an epoch peers apply ops strictly in
//!    order, so the most advanced witness holds every acknowledged op. A peer that holds nothing
//!    (e.g. restarted, memory lost) is no witness; once so many answered that no majority of
//!    witnesses can be left (a reader: once every peer did), recovery fails at once
//!    ([`Failure::Lost`]: only the operator can accept the local copy, `nearlog reseed`).
//! 3. **Fetch** the source's image in chunks, up to [`FETCH_WINDOW_CHUNKS`] requests in flight
//!    (one round trip per window instead of per chunk), checking each block's CRC32C. A corrupt
//!    source is excluded and step 2 repeats with the others (waiting for more answers if the
//!    rest is no longer a majority) — never falling back to a less advanced minority. With a
//!    local copy ([`FileClient::with_local_copy`]: a resuming writer's own file, or a stale copy
//!    on this machine) the source is first asked for its block checksums only (`Sums`); chunks
//!    whose every block matches are taken from the local copy, only the others are fetched.
//! 4. **Base**: the new epoch's op 1. Peers already holding exactly the source's state keep it
//!    (`Base { from: Some(..) }`); the others are sent the image (`Stage`) first. A peer only
//!    switches to the new epoch when the Base commits, so a half-installed peer still reports its
//!    old state. The file is ready when a majority applied the Base.
//!
//! A *reader* ([`FileClient::reader`]: a read-only open verifying its local copy) runs steps
//! 1–3 at [`READ_EPOCH`], which promises nothing, so it never fences a live writer; instead of
//! a Base it ends with the image. With a writer live elsewhere the source may change while it
//! is read: the fetch restarts against the source's newer state (which holds every op the
//! older one did), at most [`MAX_READ_ROUNDS`] times.
//!
//! Then every op gets the next `seq`; it is acknowledged once a majority applied it (acks are
//! cumulative). Lost records are resent on `Input::Tick` from a bounded buffer; a peer that lags
//! beyond the buffer is dropped for the rest of the session (it is re-based at the next open).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::proto::{Epoch, FileId, Holding, Op, PeerId, PeerReply, PeerRequest, BLOCK_BYTES, MAX_CHUNK_BYTES, MAX_SUMS_BYTES, READ_EPOCH};

/// An image sent to a peer (a Stage before its Base, a resync) is not sent again until it had
/// time to arrive at this rate, on top of `retransmit_after_us`: a peer still taking in tens of
/// MB is not sent the whole image a second time (that doubled the transfer and the sender's
/// queue for a lagging peer after a crash).
const IMAGE_SEND_BYTES_PER_US: u64 = 20;

fn image_send_us(bytes: usize) -> u64 {
    bytes as u64 / IMAGE_SEND_BYTES_PER_US
}

/// Records sent ahead of a peer's last acknowledgement before it must catch up by retransmission.
const PIPELINE_RECORDS: u64 = 4096;
/// Fetch requests of `MAX_CHUNK_BYTES` each in flight to the recovery source: bounds the
/// out-of-order buffer to this many chunks while hiding the per-request latency.
pub const FETCH_WINDOW_CHUNKS: u64 = 8;
/// A peer that had no room for an image even after releasing its old copy is asked again
/// after this many retransmission intervals (not in a tight loop of whole images).
const NO_ROOM_RETRY_FACTOR: u64 = 10;
/// Times a reader restarts its fetch because the source changed under it (a writer elsewhere
/// is live) before it gives up loudly ([`Failure::KeptChanging`]).
pub const MAX_READ_ROUNDS: u32 = 16;

/// Limits and timers of a [`FileClient`].
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Bytes of records kept for peers that have not acknowledged them yet.
    pub max_buffered_bytes: usize,
    /// A peer that acknowledged nothing new for this long is sent its missing records again.
    pub retransmit_after_us: u64,
    /// Records resent to one peer per retransmission.
    pub retransmit_batch_records: usize,
    /// An image at least this large is sent to a peer that holds an older copy as a patch (its
    /// block checksums first, then only the blocks that differ); smaller ones go whole (the
    /// extra round trip would cost more than the bytes).
    pub patch_min_bytes: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig { max_buffered_bytes: 16 * 1024 * 1024, retransmit_after_us: 200_000, retransmit_batch_records: 256, patch_min_bytes: 256 * 1024 }
    }
}

/// Why a file can no longer be written (the driver turns these into EIO/ENOSPC).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error("fenced: a newer open (epoch {promised}) took over this log file")]
    Fenced { promised: Epoch },
    #[error("log peer {peer} has no room left in its lent region ({used_bytes} of {region_bytes} bytes used)")]
    RegionFull { peer: PeerId, region_bytes: u64, used_bytes: u64 },
    #[error("log peer {peer} refused a request: {reason}")]
    Refused { peer: PeerId, reason: String },
    #[error("fewer than a majority of log peers can follow this file")]
    NoMajority,
    /// More than a minority of the peers that must witness recovery answered that they hold no
    /// copy (restarted: their memory is gone; or their copy was corrupt): no majority can ever
    /// vouch for what was acknowledged, so waiting is pointless. Only the operator can decide
    /// that the local copy is the truth (`understudy nearlog reseed`).
    #[error(
        "the log peers lost this file: at least {without_copy} of its {peers} log peers hold no copy of it (restarted: a log peer keeps files in memory only), \
         so no majority can vouch for its acknowledged writes; if the local copy holds what you want, re-seed the peers from it with \
         `understudy nearlog reseed --cluster CLUSTER_FILE PATH` (run it before the application opens the file)"
    )]
    Lost { without_copy: usize, peers: usize },
    #[error("the log file kept changing on its peers while it was read ({rounds} rounds)")]
    KeptChanging { rounds: u32 },
}

#[derive(Debug)]
enum Phase {
    Probing,
    Fetching(Fetch),
    Basing { source: Option<(PeerId, Holding)>, image: Vec<u8> },
    Ready,
    Failed(Failure),
}

/// Recovery's fetch of the source's image: `image` is the verified contiguous prefix; chunks
/// that arrived ahead of it wait in `ahead` (at most the window).
#[derive(Debug)]
struct Fetch {
    source: PeerId,
    holding: Holding,
    image: Vec<u8>,
    ahead: BTreeMap<u64, Vec<u8>>,
    /// Every chunk below this offset was requested (or is taken from the local copy).
    requested: u64,
    /// The local copy (empty: none), and the chunk offsets whose every block matches the
    /// source's checksum (taken from it instead of fetched).
    local: Vec<u8>,
    local_ok: BTreeSet<u64>,
    /// Offsets of `Sums` requests not answered yet (chunks are fetched once all are in).
    sums_pending: BTreeSet<u64>,
}

impl Fetch {
    fn chunk_len(&self, offset: u64) -> usize {
        (self.holding.size - offset).min(MAX_CHUNK_BYTES as u64) as usize
    }
}

#[derive(Debug, Default, Clone)]
struct Track {
    /// Ops of this epoch the peer applied (0: not even the Base).
    applied: u64,
    last_send_us: u64,
    lost: bool,
    /// The peer needs the full image before the Base.
    needs_image: bool,
    /// Lost, and seen alive without this epoch's state: wants a resync (driver supplies the image).
    want_resync: bool,
    /// Being re-based mid-session at this seq with this image.
    resync: Option<(u64, Vec<u8>)>,
    /// The last image sent was refused for lack of room (the peer is `lost` meanwhile): ask
    /// again at this time, or as soon as it may release its old copy if it was not allowed to.
    no_room: Option<u64>,
    /// An image sent to it allowed the peer to release its old copy (it may have).
    superseding: bool,
    /// The Base last sent to it (resent if its ack never comes).
    base: Option<Op>,
    /// Patching (see [`push_image`]): the checksums of its copy were asked, not answered yet.
    patch_wait: bool,
    /// The block checksums of its committed copy, for the next image sent to it.
    peer_sums: Option<Vec<u32>>,
    /// The last image sent to it was a patch (a NeedImage answer: it did not apply).
    patched: bool,
    /// Send it whole images (it holds no copy, a patch did not apply, or it had no room).
    no_patch: bool,
    /// Its last answer said it holds no copy of the file (restarted): nothing to patch.
    empty: bool,
}

/// Payload bytes of images sent to peers: whole, and as patches (only differing blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImageBytes {
    pub whole: u64,
    pub patch: u64,
    /// Bytes of the images that were patched (what whole images would have cost).
    pub patched_images: u64,
}

/// What [`push_image`] needs of its [`FileClient`] (the image itself lives in the client's phase
/// or in a track, so the client cannot be borrowed whole).
struct ImageTo<'a> {
    file: FileId,
    epoch: Epoch,
    now_us: u64,
    patch_min_bytes: usize,
    out: &'a mut Vec<(PeerId, PeerRequest)>,
    sent: &'a mut ImageBytes,
}

/// Sends peer `p` the image of a `Base { from: None }` at `seq` (the caller sends the Base after
/// it when this returns true). A peer that may hold an older copy is patched: it is first asked
/// for its copy's block checksums (returns false: called again when they arrive, see
/// `Input::Reply`), then sent `StageCopy` and only the blocks whose checksums differ.
/// A peer without a copy (`NoCopy`), or whose patched image did not check (`NeedImage`), gets
/// whole images from then on.
fn push_image(to: ImageTo<'_>, p: PeerId, t: &mut Track, seq: u64, image: &[u8], supersede: bool) -> bool {
    let (file, epoch) = (to.file, to.epoch);
    let size = image.len() as u64;
    if !t.no_patch && !t.empty && image.len() >= to.patch_min_bytes && size <= MAX_SUMS_BYTES {
        let Some(sums) = t.peer_sums.take() else {
            t.patch_wait = true;
            t.last_send_us = to.now_us;
            to.out.push((p, PeerRequest::Sums { file, epoch, offset: 0, len: MAX_SUMS_BYTES }));
            return false;
        };
        t.patch_wait = false;
        t.patched = true;
        to.out.push((p, PeerRequest::StageCopy { file, epoch, seq, size }));
        let blocks = image.len().div_ceil(BLOCK_BYTES);
        let block = |b: usize| &image[b * BLOCK_BYTES..((b + 1) * BLOCK_BYTES).min(image.len())];
        let mut sent = 0u64;
        let mut run: Option<usize> = None;
        for b in 0..=blocks {
            let differs = b < blocks && sums.get(b) != Some(&crc32c::crc32c(block(b)));
            if differs {
                run.get_or_insert(b);
                continue;
            }
            let Some(first) = run.take() else { continue };
            let (lo, hi) = (first * BLOCK_BYTES, (b * BLOCK_BYTES).min(image.len()));
            for at in (lo..hi).step_by(MAX_CHUNK_BYTES) {
                let data = image[at..(at + MAX_CHUNK_BYTES).min(hi)].to_vec();
                sent += data.len() as u64;
                to.out.push((p, PeerRequest::Stage { file, epoch, seq, size, offset: at as u64, data, supersede: false }));
            }
        }
        to.sent.patch += sent;
        to.sent.patched_images += size;
        t.last_send_us = to.now_us + image_send_us(sent as usize);
        return true;
    }
    t.patched = false;
    // Sticky: once allowed, the peer may have released its copy (a lost reply).
    t.superseding |= supersede;
    t.last_send_us = to.now_us + image_send_us(image.len());
    to.sent.whole += size;
    for (i, chunk) in image.chunks(MAX_CHUNK_BYTES).enumerate() {
        to.out.push((p, PeerRequest::Stage { file, epoch, seq, size, offset: (i * MAX_CHUNK_BYTES) as u64, data: chunk.to_vec(), supersede }));
    }
    true
}

/// An input to a [`FileClient`] ([`FileClient::handle`]).
///
/// Time is an input (`Tick`), not an argument of every call: the client's clock moves only when
/// the driver ticks it, and a reply or a submit is stamped with the last tick. That is how the
/// drivers (the shim, the mover) and the simulations have always run the client (a tick before
/// each round of sends), so their traces stay exactly what they were.
#[derive(Debug)]
pub enum Input {
    /// The driver's clock (µs, monotonic): resends what was not acknowledged in time.
    Tick { now_us: u64 },
    /// A peer's reply to one of the client's requests (any order, duplicates and strays are
    /// ignored).
    Reply { peer: PeerId, reply: PeerReply },
    /// Replicate one op (only when ready; [`FileClient::submit`] also returns its seq). A
    /// failed client ignores it.
    Submit(Op),
    /// The local copy asked for by [`FileClient::wants_local_copy`].
    LocalCopy(Vec<u8>),
    /// The known state's image asked for by [`FileClient::wants_image`].
    Image(Vec<u8>),
    /// The current image for the peer named by [`FileClient::wants_resync`].
    Resync { peer: PeerId, image: Vec<u8> },
}

/// The client's only output: a request to send to a peer ([`FileClient::take_outputs`]).
pub type Output = (PeerId, PeerRequest);

/// One open log file: inputs through [`FileClient::handle`], outputs from
/// [`FileClient::take_outputs`], [`FileClient::check_invariants`] after every input in debug
/// builds.
#[derive(Debug)]
pub struct FileClient {
    file: FileId,
    epoch: Epoch,
    peers: Vec<PeerId>,
    majority: usize,
    /// The peers a majority of which must witness recovery (the grant's `recover_from` while a
    /// move is pending, else `peers`).
    witness_set: Vec<PeerId>,
    /// Peers only probed and fetched from (old members of a pending move): last send time.
    extra: BTreeMap<PeerId, u64>,
    cfg: ClientConfig,
    initialized: bool,
    phase: Phase,
    probes: BTreeMap<PeerId, Option<Holding>>,
    excluded: BTreeSet<PeerId>,
    tracks: BTreeMap<PeerId, Track>,
    ops: VecDeque<(u64, Op)>,
    ops_bytes: usize,
    next_seq: u64,
    acked_seq: u64,
    size: u64,
    recovered: Option<Vec<u8>>,
    initial: Vec<u8>,
    /// A local copy recovery may take verified chunks from ([`FileClient::with_local_copy`]).
    local_hint: Option<Vec<u8>>,
    /// A reader ([`FileClient::reader`]): recovery ends with the image, no Base; and the fetch
    /// restarts it went through.
    read_only: bool,
    read_rounds: u32,
    /// A reader's caller holds exactly the image of this state (it wrote it from an earlier
    /// read in the same process and the file is unchanged since): if a majority's most
    /// advanced copy is still this state, nothing is fetched or compared.
    known: Option<Holding>,
    /// The state a reader's image is (set when it is ready).
    read_state: Option<Holding>,
    /// The source was at the `known` state (no image: the caller's copy is current).
    matched_known: bool,
    /// The source is not at the `known` state: the recovery source and its state, while the
    /// driver reads its local copy ([`FileClient::wants_local_copy`]) so that only the chunks
    /// that differ from it are fetched.
    local_wanted: Option<(PeerId, Holding)>,
    /// Basing on the `known` state without its bytes (the caller's copy is the image): only a
    /// peer that needs the image makes the driver read it ([`FileClient::wants_image`]).
    image_elided: bool,
    /// Recovery's bytes fetched from the source and taken from the local copy.
    fetched_bytes: u64,
    reused_bytes: u64,
    /// Images sent to peers (Bases that needed one, resyncs).
    image_bytes: ImageBytes,
    now_us: u64,
    out: Vec<(PeerId, PeerRequest)>,
}

impl FileClient {
    /// Starts recovery of `file` at `epoch` over `peers`. `initialized` is the controller's word
    /// that some earlier open committed content; if not, the file starts as `initial` (the local
    /// copy, for a file that existed before it was replicated; usually empty).
    pub fn open(file: FileId, epoch: Epoch, peers: Vec<PeerId>, initialized: bool, initial: Vec<u8>, cfg: ClientConfig, now_us: u64) -> FileClient {
        Self::open_moving(file, epoch, peers, Vec::new(), initialized, initial, cfg, now_us)
    }

    /// [`FileClient::open`] of a file with a pending move: recovery needs witnesses from a
    /// majority of `recover_from` (the set the last committed epoch ran on; also probed and
    /// fetched from), and the new epoch is based on `peers` (a new member gets the image).
    /// Empty `recover_from`: no move pending.
    #[allow(clippy::too_many_arguments)]
    pub fn open_moving(
        file: FileId,
        epoch: Epoch,
        peers: Vec<PeerId>,
        recover_from: Vec<PeerId>,
        initialized: bool,
        initial: Vec<u8>,
        cfg: ClientConfig,
        now_us: u64,
    ) -> FileClient {
        assert!(!peers.is_empty(), "a log file needs at least one peer");
        let majority = peers.len() / 2 + 1;
        let tracks = peers.iter().map(|&p| (p, Track { last_send_us: now_us, ..Track::default() })).collect();
        let witness_set = if recover_from.is_empty() { peers.clone() } else { recover_from };
        let extra = witness_set.iter().filter(|p| !peers.contains(p)).map(|&p| (p, now_us)).collect();
        let mut c = FileClient {
            file,
            epoch,
            majority,
            witness_set,
            extra,
            cfg,
            initialized,
            phase: Phase::Probing,
            probes: BTreeMap::new(),
            excluded: BTreeSet::new(),
            tracks,
            ops: VecDeque::new(),
            ops_bytes: 0,
            next_seq: 0,
            acked_seq: 0,
            size: 0,
            recovered: None,
            initial,
            local_hint: None,
            read_only: false,
            read_rounds: 0,
            known: None,
            read_state: None,
            matched_known: false,
            local_wanted: None,
            image_elided: false,
            fetched_bytes: 0,
            reused_bytes: 0,
            image_bytes: ImageBytes::default(),
            now_us,
            out: Vec::new(),
            peers,
        };
        for p in c.probe_set() {
            c.out.push((p, PeerRequest::Probe { file, epoch }));
        }
        c
    }

    /// A reader of `file` (a read-only open verifying its local copy, which it gives with
    /// [`FileClient::with_local_copy`]): finds the most advanced member of a majority of
    /// `peers` (or of `recover_from` while a move is pending) and reads its image at
    /// [`READ_EPOCH`] — fencing nobody, changing nothing on the peers. Ready with the image
    /// ([`FileClient::take_recovered`]); it submits nothing.
    pub fn reader(file: FileId, peers: Vec<PeerId>, recover_from: Vec<PeerId>, cfg: ClientConfig, now_us: u64) -> FileClient {
        let mut c = Self::open_moving(file, READ_EPOCH, peers, recover_from, true, Vec::new(), cfg, now_us);
        c.read_only = true;
        c
    }

    /// Gives recovery a local copy of the file (a resuming writer's own file, or what an
    /// earlier run left on this machine): only the chunks whose block checksums differ from the
    /// source's are fetched. Any content is safe: a chunk is taken from it only when every one
    /// of its blocks matches the source's CRC32C, the same check fetched bytes pass.
    pub fn with_local_copy(mut self, local: Vec<u8>) -> FileClient {
        self.local_hint = if local.is_empty() { None } else { Some(local) };
        self
    }

    /// A client whose caller's copy is exactly the image of state `h` (see `known`): when the
    /// most advanced copy of a majority is still `h`, nothing is fetched or compared
    /// ([`FileClient::matched_known`]): a reader is ready at once; a writer bases its epoch on
    /// `h` without holding the bytes, and asks for them ([`FileClient::wants_image`]) only if a
    /// peer needs the image. Otherwise recovery goes on as usual (without a local copy to
    /// take chunks from: the caller gives none).
    pub fn with_known_state(mut self, h: Holding) -> FileClient {
        self.known = Some(h);
        self
    }

    /// Recovery found the source past the state given to [`FileClient::with_known_state`] (a
    /// writer elsewhere moved it on): the driver reads its local copy (mostly the same bytes)
    /// and gives it to `Input::LocalCopy`.
    pub fn wants_local_copy(&self) -> bool {
        self.local_wanted.is_some() && matches!(self.phase, Phase::Probing)
    }

    /// The local copy asked for by [`FileClient::wants_local_copy`] (any content is safe: a
    /// chunk is only taken from it when its block checksums match the source's).
    fn supply_local_copy_input(&mut self, local: Vec<u8>) {
        let Some((source, holding)) = self.local_wanted.take() else { return };
        if !local.is_empty() {
            self.local_hint = Some(local);
        }
        self.start_fetch(source, holding);
    }

    /// Recovery found the source at the state given to [`FileClient::with_known_state`].
    pub fn matched_known(&self) -> bool {
        self.matched_known
    }

    /// A writer basing on a known state without its bytes needs them now (a peer lacks that
    /// state): the driver reads its local copy ([`FileClient::size`] bytes) and gives it to
    /// `Input::Image`.
    pub fn wants_image(&self) -> bool {
        self.image_elided && matches!(self.phase, Phase::Basing { .. }) && self.tracks.values().any(|t| t.needs_image)
    }

    /// The image of the known state (see [`FileClient::wants_image`]): the peers that need it
    /// are sent it.
    fn supply_image_input(&mut self, image: Vec<u8>) {
        assert!(self.wants_image(), "supply_image only when asked");
        assert_eq!(image.len() as u64, self.size, "the known state's image must have its size");
        let Phase::Basing { image: slot, .. } = &mut self.phase else { unreachable!() };
        *slot = image;
        self.image_elided = false;
        let need: Vec<PeerId> = self.tracks.iter().filter(|(_, t)| t.needs_image && !t.lost).map(|(&p, _)| p).collect();
        for p in need {
            self.send_base(p);
        }
    }

    /// A writer's state once every submitted op is on a majority: what the most advanced copy
    /// of a majority is until another client opens the file (a caller that keeps the content
    /// may give it to [`FileClient::with_known_state`] of a later open).
    pub fn committed_state(&self) -> Option<Holding> {
        (!self.read_only && self.is_ready() && self.acked_seq >= self.next_seq).then_some(Holding { epoch: self.epoch, seq: self.next_seq, size: self.size })
    }

    /// The state a ready reader's image (or the caller's matching copy) is.
    pub fn read_state(&self) -> Option<Holding> {
        self.read_state
    }

    /// Recovery's bytes so far: (fetched from the source, taken from the local copy).
    pub fn recovery_bytes(&self) -> (u64, u64) {
        (self.fetched_bytes, self.reused_bytes)
    }

    /// Payload bytes of the images sent to peers so far, whole and patched.
    pub fn image_bytes(&self) -> ImageBytes {
        self.image_bytes
    }

    /// Every peer recovery talks to: the new set and the old members of a pending move.
    fn probe_set(&self) -> Vec<PeerId> {
        self.peers.iter().copied().chain(self.extra.keys().copied()).collect()
    }

    fn last_send(&self, p: PeerId) -> u64 {
        self.tracks.get(&p).map(|t| t.last_send_us).or_else(|| self.extra.get(&p).copied()).unwrap_or(0)
    }

    fn touch(&mut self, p: PeerId) {
        let now = self.now_us;
        if let Some(t) = self.tracks.get_mut(&p) {
            t.last_send_us = now;
        } else if let Some(t) = self.extra.get_mut(&p) {
            *t = now;
        }
    }

    /// The submitted ops no majority acknowledged yet, in order (a writer that is fenced by a
    /// mover or relocates resubmits them in its next epoch: re-applying a suffix of ops on any
    /// state between the acknowledged one and the last gives the same result).
    pub fn unacked_ops(&self) -> Vec<Op> {
        self.ops.iter().filter(|(s, _)| *s > self.acked_seq).map(|(_, op)| op.clone()).collect()
    }

    pub fn file(&self) -> FileId {
        self.file
    }
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }
    pub fn peers(&self) -> &[PeerId] {
        &self.peers
    }
    /// The replicated file size (after every submitted op).
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn is_ready(&self) -> bool {
        matches!(self.phase, Phase::Ready)
    }
    pub fn failure(&self) -> Option<&Failure> {
        match &self.phase {
            Phase::Failed(f) => Some(f),
            _ => None,
        }
    }
    /// Highest seq held by a majority: every op up to it is durable.
    pub fn acked_seq(&self) -> u64 {
        self.acked_seq
    }
    pub fn last_seq(&self) -> u64 {
        self.next_seq
    }
    /// The recovered content, once ready (taken once: the driver writes it to the local file).
    pub fn take_recovered(&mut self) -> Option<Vec<u8>> {
        self.recovered.take()
    }
    /// The requests to send since the last call ([`Output`]: the client's only output).
    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }
    /// Every peer of the set applied every submitted op (a new member is fully up to date).
    pub fn fully_replicated(&self) -> bool {
        self.is_ready() && self.tracks.values().all(|t| !t.lost && t.resync.is_none() && t.applied >= self.next_seq)
    }
    /// Bytes of records buffered for retransmission.
    pub fn buffered_bytes(&self) -> usize {
        self.ops_bytes
    }

    fn fail(&mut self, f: Failure) {
        if !matches!(self.phase, Phase::Failed(_)) {
            self.phase = Phase::Failed(f);
        }
    }

    /// What must only move forward between inputs: the acknowledged seq, and failure (terminal).
    #[cfg(debug_assertions)]
    fn progress(&self) -> (u64, bool) {
        (self.acked_seq, matches!(self.phase, Phase::Failed(_)))
    }

    /// After every input in debug builds: acknowledgement never goes back, a failure is final,
    /// and the invariants hold.
    #[cfg(debug_assertions)]
    fn check_after_input(&self, (acked, failed): (u64, bool)) {
        if self.acked_seq < acked {
            panic!("file client {}: invariant `the acknowledged seq never decreases` broken: {acked} -> {}", self.file, self.acked_seq);
        }
        if failed && !matches!(self.phase, Phase::Failed(_)) {
            panic!("file client {}: invariant `a failure is final` broken: now {:?}", self.file, self.phase_name());
        }
        self.check_invariants();
    }

    fn phase_name(&self) -> &'static str {
        match &self.phase {
            Phase::Probing => "Probing",
            Phase::Fetching(_) => "Fetching",
            Phase::Basing { .. } => "Basing",
            Phase::Ready => "Ready",
            Phase::Failed(_) => "Failed",
        }
    }

    /// Panics, naming the invariant and the state, if the client's state breaks a rule the
    /// module doc states. O(peers + fetch window), never O(buffered records or bytes). Run after
    /// every input in debug builds and after every step of the simulations.
    pub fn check_invariants(&self) {
        let broken = |what: &str, state: String| -> ! {
            panic!("file client {} (epoch {}, {}): invariant `{what}` broken: {state}", self.file, self.epoch, self.phase_name())
        };
        // A majority of the file's peers; one track per peer.
        if self.majority != self.peers.len() / 2 + 1 || self.tracks.len() != self.peers.len() || self.peers.iter().any(|p| !self.tracks.contains_key(p)) {
            broken("one track per peer, majority of the peers", format!("peers {:?}, tracks {:?}, majority {}", self.peers, self.tracks.keys(), self.majority));
        }
        // Nothing is acknowledged that was not submitted, and peers apply only what was sent.
        if self.acked_seq > self.next_seq {
            broken("acknowledged ops were submitted", format!("acked {} next {}", self.acked_seq, self.next_seq));
        }
        if let Some((p, t)) = self.tracks.iter().find(|(_, t)| t.applied > self.next_seq) {
            broken("a peer applied only ops that were submitted", format!("peer {p} applied {}, next {}", t.applied, self.next_seq));
        }
        // Ready (a writer): its Base is on a majority.
        if matches!(self.phase, Phase::Ready) && !self.read_only && self.acked_seq < 1 {
            broken("a ready writer's Base is on a majority", format!("acked {}", self.acked_seq));
        }
        // The retransmission buffer holds a contiguous run of ops ending at the last submitted.
        if let (Some((first, _)), Some((last, _))) = (self.ops.front(), self.ops.back()) {
            if *last != self.next_seq || last - first + 1 != self.ops.len() as u64 {
                broken("buffered ops are contiguous up to the last submitted", format!("{first}..={last} ({} ops), next {}", self.ops.len(), self.next_seq));
            }
        }
        if self.read_only && !self.ops.is_empty() {
            broken("a reader submits nothing", format!("{} ops", self.ops.len()));
        }
        // The fetch: a verified prefix of the source's image, at most FETCH_WINDOW_CHUNKS ahead.
        if let Phase::Fetching(f) = &self.phase {
            if f.image.len() as u64 > f.holding.size || f.ahead.len() as u64 > FETCH_WINDOW_CHUNKS {
                broken("the fetch holds a prefix of the image and at most FETCH_WINDOW_CHUNKS ahead", format!("{} of {} bytes, {} ahead", f.image.len(), f.holding.size, f.ahead.len()));
            }
        }
        if self.read_rounds > MAX_READ_ROUNDS + 1 {
            broken("a reader restarts at most MAX_READ_ROUNDS times", format!("{} rounds", self.read_rounds));
        }
    }

    /// The checks that walk the retransmission buffer (O(buffered ops)): too dear after every
    /// input of a writer, run by the simulations after every step. Also runs
    /// [`Self::check_invariants`].
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
        let bytes: usize = self.ops.iter().map(|(_, op)| op.payload_bytes()).sum();
        if bytes != self.ops_bytes {
            panic!("file client {}: invariant `ops_bytes accounts the buffered records` broken: counted {} held {bytes}", self.file, self.ops_bytes);
        }
    }

    /// Applies one input; the requests it makes wait in [`FileClient::take_outputs`]. In debug
    /// builds every input is followed by the invariant checks (acknowledgement never goes back,
    /// a failure is final, [`FileClient::check_invariants`]).
    pub fn handle(&mut self, input: Input) {
        #[cfg(debug_assertions)]
        let before = self.progress();
        match input {
            Input::Tick { now_us } => self.tick_input(now_us),
            Input::Reply { peer, reply } => self.on_reply_input(peer, reply),
            Input::Submit(op) => {
                // A failed client refuses (`submit` reports it); nothing changed.
                let _ = self.submit_input(op);
            }
            Input::LocalCopy(local) => self.supply_local_copy_input(local),
            Input::Image(image) => self.supply_image_input(image),
            Input::Resync { peer, image } => self.resync_input(peer, image),
        }
        #[cfg(debug_assertions)]
        self.check_after_input(before);
    }

    /// `handle(Input::Submit(op))`, returning the op's seq (wait until `acked_seq() >= seq`),
    /// or the failure that refused it.
    pub fn submit(&mut self, op: Op) -> Result<u64, Failure> {
        // `handle(Submit)` of a failed client changes nothing; a ready one takes the next seq
        // (trimming the buffer never fails it).
        if let Some(f) = self.failure() {
            return Err(f.clone());
        }
        self.handle(Input::Submit(op));
        Ok(self.next_seq)
    }

    fn submit_input(&mut self, op: Op) -> Result<u64, Failure> {
        match &self.phase {
            Phase::Ready => {}
            Phase::Failed(f) => return Err(f.clone()),
            _ => panic!("submit before the file is ready"),
        }
        assert!(!self.read_only, "a reader submits nothing");
        self.size = match &op {
            Op::Write { offset, data, .. } => self.size.max(offset + data.len() as u64),
            Op::Truncate { size } => *size,
            Op::Base { .. } => panic!("Base is the client's own op"),
        };
        self.next_seq += 1;
        let seq = self.next_seq;
        self.ops_bytes += op.payload_bytes();
        let now = self.now_us;
        for (&p, t) in self.tracks.iter_mut() {
            if !t.lost && t.applied + 1 == seq {
                // It had everything: its retransmission timer starts now (not at its last ack,
                // which may be long ago after an idle spell: that resent this record at once).
                t.last_send_us = now;
            }
            // Peers far behind get their records, in order, from the retransmission instead.
            if !t.lost && t.applied + PIPELINE_RECORDS >= seq {
                self.out.push((p, PeerRequest::Record { file: self.file, epoch: self.epoch, seq, op: op.clone() }));
            }
        }
        self.ops.push_back((seq, op));
        self.trim()?;
        Ok(seq)
    }

    /// Drops records every live peer holds; drops the slowest peers while the buffer is over its
    /// limit and more than a majority would remain.
    fn trim(&mut self) -> Result<(), Failure> {
        loop {
            let min_applied = self
                .tracks
                .values()
                .filter_map(|t| match (&t.resync, t.lost) {
                    (Some((seq, _)), _) => Some(*seq),
                    (None, false) => Some(t.applied),
                    (None, true) => None,
                })
                .min()
                .unwrap_or(self.next_seq);
            while let Some((seq, _)) = self.ops.front() {
                if *seq > min_applied {
                    break;
                }
                let (_, op) = self.ops.pop_front().unwrap();
                self.ops_bytes -= op.payload_bytes();
            }
            if self.ops_bytes <= self.cfg.max_buffered_bytes {
                return Ok(());
            }
            let live = self.tracks.values().filter(|t| !t.lost).count();
            if live <= self.majority {
                // Every remaining peer is needed: the caller waits for acks (backpressure).
                return Ok(());
            }
            let slowest = self.tracks.iter().filter(|(_, t)| !t.lost && t.resync.is_none()).min_by_key(|(_, t)| t.applied).map(|(&p, _)| p).unwrap();
            self.tracks.get_mut(&slowest).unwrap().lost = true;
        }
    }

    /// Advances the clock; resends what was not acknowledged in time.
    fn tick_input(&mut self, now_us: u64) {
        self.now_us = now_us;
        let after = self.cfg.retransmit_after_us;
        let due = move |t: &Track| now_us.saturating_sub(t.last_send_us) >= after;
        let due_at = move |last: u64| now_us.saturating_sub(last) >= after;
        match &self.phase {
            Phase::Failed(_) => {}
            Phase::Probing | Phase::Fetching(_) => {
                if let Phase::Fetching(f) = &self.phase {
                    let source = f.source;
                    if due_at(self.last_send(source)) {
                        // No progress for a while: ask again for every chunk of the window
                        // not received yet (late duplicates are ignored).
                        let missing: Vec<u64> = (f.image.len() as u64..f.requested)
                            .step_by(MAX_CHUNK_BYTES)
                            .filter(|o| !f.ahead.contains_key(o) && !f.local_ok.contains(o))
                            .collect();
                        let sums: Vec<u64> = f.sums_pending.iter().copied().collect();
                        self.touch(source);
                        for o in missing {
                            self.out.push((source, self.fetch(o)));
                        }
                        for o in sums {
                            self.out.push((source, self.sums(o)));
                        }
                    }
                }
                // Peers still silent (while fetching: needed if the source turns out corrupt).
                for p in self.probe_set() {
                    if !self.probes.contains_key(&p) && due_at(self.last_send(p)) {
                        self.touch(p);
                        self.out.push((p, PeerRequest::Probe { file: self.file, epoch: self.epoch }));
                    }
                }
            }
            Phase::Basing { .. } => {
                self.retry_no_room();
                for p in self.probe_set() {
                    let unanswered = !self.probes.contains_key(&p);
                    match self.tracks.get(&p) {
                        Some(t) if t.applied == 0 && !t.lost && due(t) => {
                            self.send_base(p);
                            // A missing answer bounds the acknowledged ops more tightly
                            // (`acked_bound`): ask again along with the Base.
                            if unanswered {
                                self.out.push((p, PeerRequest::Probe { file: self.file, epoch: self.epoch }));
                            }
                        }
                        Some(t) if t.lost && unanswered && due(t) => {
                            self.touch(p);
                            self.out.push((p, PeerRequest::Probe { file: self.file, epoch: self.epoch }));
                        }
                        None if unanswered && due_at(self.last_send(p)) => {
                            self.touch(p);
                            self.out.push((p, PeerRequest::Probe { file: self.file, epoch: self.epoch }));
                        }
                        _ => {}
                    }
                }
            }
            Phase::Ready => {
                for p in self.peers.clone() {
                    let t = &self.tracks[&p];
                    if !due(t) {
                        continue;
                    }
                    if t.resync.is_some() {
                        self.send_resync(p);
                        continue;
                    }
                    if t.lost {
                        if t.no_room.is_some_and(|at| now_us < at) {
                            continue; // its region was full: not before the back-off
                        }
                        // Is it back, and with what? A peer that lost its memory wants a resync.
                        self.tracks.get_mut(&p).unwrap().last_send_us = now_us;
                        self.out.push((p, PeerRequest::Probe { file: self.file, epoch: self.epoch }));
                        continue;
                    }
                    if t.applied >= self.next_seq {
                        continue;
                    }
                    if t.applied == 0 && self.ops.front().is_none_or(|(s, _)| *s > 2) {
                        // Its Base (or the ack) was lost and no later record is left to resend
                        // (acks are cumulative): the Base again, without the image (a peer that
                        // cannot apply it answers NeedImage and is resynced).
                        if let Some(op) = t.base.clone() {
                            self.tracks.get_mut(&p).unwrap().last_send_us = now_us;
                            self.out.push((p, PeerRequest::Record { file: self.file, epoch: self.epoch, seq: 1, op }));
                        }
                        continue;
                    }
                    let from = t.applied + 1;
                    self.tracks.get_mut(&p).unwrap().last_send_us = now_us;
                    let batch = self.cfg.retransmit_batch_records;
                    for (seq, op) in self.ops.iter().filter(|(s, _)| *s >= from).take(batch) {
                        self.out.push((p, PeerRequest::Record { file: self.file, epoch: self.epoch, seq: *seq, op: op.clone() }));
                    }
                }
            }
        }
    }

    /// A peer that is alive but lost this file's state (restarted, or fell behind the buffer),
    /// if any: the driver answers with `Input::Resync` and the current image.
    pub fn wants_resync(&self) -> Option<PeerId> {
        if !matches!(self.phase, Phase::Ready) {
            return None;
        }
        self.tracks.iter().find(|(_, t)| t.want_resync && t.resync.is_none()).map(|(&p, _)| p)
    }

    /// Re-bases `peer` mid-session: `image` must be the file's content after every op submitted
    /// so far (the driver reads its local copy). Later records reach it by retransmission.
    fn resync_input(&mut self, peer: PeerId, image: Vec<u8>) {
        assert!(matches!(self.phase, Phase::Ready), "resync only when ready");
        assert_eq!(image.len() as u64, self.size, "resync image must have the replicated size");
        let t = self.tracks.get_mut(&peer).unwrap();
        t.want_resync = false;
        t.resync = Some((self.next_seq, image));
        self.send_resync(peer);
    }

    fn send_resync(&mut self, p: PeerId) {
        let supersede = self.may_release(p);
        let t = self.tracks.get_mut(&p).unwrap();
        let Some((seq, image)) = t.resync.take() else { return };
        let to = ImageTo { file: self.file, epoch: self.epoch, now_us: self.now_us, patch_min_bytes: self.cfg.patch_min_bytes, out: &mut self.out, sent: &mut self.image_bytes };
        let ready = push_image(to, p, t, seq, &image, supersede);
        let (size, image_crc) = (image.len() as u64, crc32c::crc32c(&image));
        t.resync = Some((seq, image));
        if ready {
            self.out.push((p, PeerRequest::Record { file: self.file, epoch: self.epoch, seq, op: Op::Base { from: None, size, image_crc } }));
        }
    }

    /// Sends `p` its image again (its checksums arrived, or a patch cannot be made).
    fn resend_image(&mut self, p: PeerId) {
        if self.tracks[&p].resync.is_some() {
            self.send_resync(p);
        } else if matches!(self.phase, Phase::Basing { .. }) {
            self.send_base(p);
        } else if matches!(self.phase, Phase::Ready) {
            // Its epoch's image went with the Base: it is resynced from the driver's copy.
            let t = self.tracks.get_mut(&p).unwrap();
            if t.applied == 0 {
                (t.lost, t.want_resync) = (true, true);
            }
        }
    }

    fn fetch(&self, offset: u64) -> PeerRequest {
        PeerRequest::Fetch { file: self.file, epoch: self.epoch, offset, len: MAX_CHUNK_BYTES as u32 }
    }

    fn sums(&self, offset: u64) -> PeerRequest {
        PeerRequest::Sums { file: self.file, epoch: self.epoch, offset, len: MAX_SUMS_BYTES }
    }

    /// One reply from a peer. Over 100 lines on purpose: one arm per reply kind, each a few
    /// lines of the same recovery/replication state machine (split into one function per
    /// kind, the protocol's answer to each reply would be spread over a dozen functions).
    fn on_reply_input(&mut self, peer: PeerId, reply: PeerReply) {
        if !(self.tracks.contains_key(&peer) || self.extra.contains_key(&peer)) || reply.file() != Some(self.file) {
            return;
        }
        if !self.tracks.contains_key(&peer) {
            // An old member of a pending move: it only answers probes and fetches.
            match reply {
                PeerReply::Stale { promised, .. } if promised > self.epoch => self.fail(Failure::Fenced { promised }),
                PeerReply::Probed { epoch, holding, .. } if epoch == self.epoch && matches!(self.phase, Phase::Probing | Phase::Fetching(_) | Phase::Basing { .. }) => {
                    self.on_probed(peer, holding)
                }
                PeerReply::Data { offset, data, block_crcs, holding, .. } => self.on_data(peer, offset, data, block_crcs, holding),
                PeerReply::Sums { offset, block_crcs, holding, .. } => self.on_sums(peer, offset, block_crcs, holding),
                PeerReply::NoCopy { .. } if matches!(&self.phase, Phase::Fetching(f) if f.source == peer) => self.exclude_source(peer),
                _ => {}
            }
            return;
        }
        if self.tracks[&peer].patch_wait {
            // Answers to the checksums asked for a patch ([`push_image`]).
            match reply {
                PeerReply::Sums { offset: 0, block_crcs, holding, .. } => {
                    let t = self.tracks.get_mut(&peer).unwrap();
                    t.patch_wait = false;
                    if block_crcs.len() as u64 == holding.size.min(MAX_SUMS_BYTES).div_ceil(BLOCK_BYTES as u64) {
                        t.peer_sums = Some(block_crcs);
                    } else {
                        t.no_patch = true; // a malformed answer: no patching for it
                    }
                    self.resend_image(peer);
                    return;
                }
                PeerReply::NoCopy { .. } => {
                    let t = self.tracks.get_mut(&peer).unwrap();
                    t.patch_wait = false;
                    t.no_patch = true;
                    self.resend_image(peer);
                    return;
                }
                // A late answer to a Base sent before the patch began: the patch's Base follows.
                PeerReply::NeedImage { .. } => return,
                _ => {}
            }
        }
        match reply {
            PeerReply::Stale { promised, .. } if promised > self.epoch => self.fail(Failure::Fenced { promised }),
            PeerReply::RegionFull { region_bytes, used_bytes, epoch, .. } if epoch == self.epoch => {
                let basing = matches!(self.phase, Phase::Basing { .. });
                let now = self.now_us;
                let backoff = self.cfg.retransmit_after_us.saturating_mul(NO_ROOM_RETRY_FACTOR).max(1);
                let t = self.tracks.get_mut(&peer).unwrap();
                // Before its Base a peer's only op that takes room is an image (Stage or
                // StageCopy: records of the epoch wait for the Base), also one answered after the
                // majority made the file ready.
                if (basing && t.needs_image) || t.applied == 0 || t.resync.is_some() {
                    // An image did not fit: this peer is treated like a dead one while a
                    // majority carries the file (a re-base only needs a majority), and is
                    // brought up to date later (see `may_release`). Records do fail loudly.
                    t.lost = true;
                    t.resync = None;
                    t.want_resync = false;
                    t.no_room = Some(now + backoff);
                    // Next time whole, allowed to release its copy if safe (a patch keeps it).
                    (t.no_patch, t.patch_wait, t.peer_sums) = (true, false, None);
                    self.retry_no_room();
                    return;
                }
                self.fail(Failure::RegionFull { peer, region_bytes, used_bytes })
            }
            // A reader's source that dropped its copy since the probe (restarted, released):
            // no witness any more; the reader chooses again.
            PeerReply::Refused { .. } if self.read_only && matches!(&self.phase, Phase::Fetching(f) if f.source == peer) => self.exclude_source(peer),
            PeerReply::Refused { .. } if self.read_only => {}
            PeerReply::Refused { reason, .. } => self.fail(Failure::Refused { peer, reason }),
            PeerReply::Probed { epoch, holding, .. } if epoch == self.epoch => {
                if matches!(self.phase, Phase::Ready) {
                    let floor = self.ops.front().map(|(s, _)| *s - 1).unwrap_or(self.next_seq);
                    let t = self.tracks.get_mut(&peer).unwrap();
                    if t.lost && t.resync.is_none() {
                        t.empty = holding.is_none();
                        match holding {
                            Some(h) if h.epoch == self.epoch && h.seq >= floor => {
                                t.lost = false;
                                t.applied = h.seq;
                            }
                            _ => t.want_resync = true,
                        }
                    }
                    return;
                }
                if matches!(self.phase, Phase::Probing | Phase::Fetching(_) | Phase::Basing { .. }) {
                    self.on_probed(peer, holding);
                }
            }
            PeerReply::Data { offset, data, block_crcs, holding, .. } => self.on_data(peer, offset, data, block_crcs, holding),
            PeerReply::Sums { offset, block_crcs, holding, .. } => self.on_sums(peer, offset, block_crcs, holding),
            // The recovery source lost its copy since its probe (restarted, released): no witness.
            PeerReply::NoCopy { .. } if matches!(&self.phase, Phase::Fetching(f) if f.source == peer) => self.exclude_source(peer),
            PeerReply::NeedImage { epoch, .. } if epoch == self.epoch => {
                let probed_empty = matches!(self.probes.get(&peer), Some(None));
                let t = self.tracks.get_mut(&peer).unwrap();
                if std::mem::take(&mut t.patched) {
                    t.no_patch = true; // the patched image did not check: whole from now on
                }
                if t.resync.is_some() {
                    self.send_resync(peer);
                    return;
                }
                let basing = matches!(self.phase, Phase::Basing { .. });
                if basing && t.lost {
                    // Waiting for room (`retry_no_room`): a late answer to an earlier Base.
                    return;
                }
                if t.applied == 0 && basing {
                    t.needs_image = true;
                    self.send_base(peer);
                } else if t.applied == 0 && matches!(self.phase, Phase::Ready) {
                    // The image is gone: the driver resyncs it from its local copy (whole if
                    // recovery found it without a copy).
                    t.lost = true;
                    t.want_resync = true;
                    t.empty = probed_empty;
                }
            }
            PeerReply::Ack { epoch, applied_seq, .. } => {
                if epoch != self.epoch {
                    let ready = matches!(self.phase, Phase::Ready);
                    let t = self.tracks.get_mut(&peer).unwrap();
                    if ready && t.resync.is_none() {
                        // Alive but without this epoch's state (restarted: memory lost).
                        t.empty = epoch == 0;
                        t.lost = true;
                        t.want_resync = true;
                    }
                    return;
                }
                if applied_seq > self.next_seq {
                    // Acknowledges ops never sent: a misbehaving peer. Ignored (it never counts
                    // towards a majority; it is re-probed like a silent peer).
                    return;
                }
                let t = self.tracks.get_mut(&peer).unwrap();
                if let Some((seq, _)) = &t.resync {
                    if applied_seq < *seq {
                        return;
                    }
                    t.resync = None;
                    t.lost = false;
                }
                if applied_seq > t.applied {
                    t.applied = applied_seq;
                    t.last_send_us = self.now_us;
                }
                self.update_acked();
            }
            _ => {}
        }
    }

    /// A probe answer during recovery (the first one of each peer counts).
    fn on_probed(&mut self, peer: PeerId, holding: Option<Holding>) {
        self.probes.entry(peer).or_insert(holding);
        match self.phase {
            Phase::Probing => self.choose_source(),
            // A late answer may show that a peer without room can release its copy.
            Phase::Basing { .. } => self.retry_no_room(),
            _ => {}
        }
    }

    fn update_acked(&mut self) {
        let mut applied: Vec<u64> = self.tracks.values().map(|t| t.applied).collect();
        applied.sort_unstable_by(|a, b| b.cmp(a));
        let acked = applied[self.majority - 1];
        if acked > self.acked_seq {
            self.acked_seq = acked;
        }
        if matches!(self.phase, Phase::Basing { .. }) && self.acked_seq >= 1 {
            let Phase::Basing { image, .. } = std::mem::replace(&mut self.phase, Phase::Ready) else { unreachable!() };
            // Elided: the caller's copy is the content (`matched_known`), there is nothing to give.
            self.recovered = if std::mem::take(&mut self.image_elided) { None } else { Some(image) };
            // Peers that have not taken the Base yet keep getting records: a slow peer applies
            // them in order after its Base; one that needs the (now dropped) image answers
            // NeedImage and is resynced from the driver's copy.
            for t in self.tracks.values_mut() {
                t.needs_image = false;
                if t.patch_wait && t.applied == 0 {
                    // Its Base waited for its checksums, and the image is gone with the phase:
                    // it is resynced (patched) from the driver's copy.
                    (t.lost, t.want_resync) = (true, true);
                }
                if t.lost && t.no_room.is_some() && t.applied == 0 {
                    // Had no room for the image: now that a majority holds the new epoch it may
                    // release its old copy; the driver re-bases it from the local copy.
                    t.want_resync = true;
                    t.no_room = None;
                }
            }
        }
        if matches!(self.phase, Phase::Basing { .. }) {
            self.retry_no_room();
        }
        let _ = self.trim();
    }

    /// Whether a majority holds complete copies of every acknowledged op without `p` — of the
    /// grant's set and of the witness set (what the next recovery needs) — so `p` may release
    /// its old copy to make room for an image. Never releasing otherwise is what keeps a crash
    /// in the middle of a re-base recoverable.
    ///
    /// Complete: applied this epoch's Base and every acknowledged op; or, while basing, probed
    /// at a state at least [`FileClient::acked_bound`] (e.g. after ENOSPC, peers one op behind
    /// the source still hold every acknowledged op when all of them answered).
    fn may_release(&self, p: PeerId) -> bool {
        let bound = match &self.phase {
            Phase::Basing { .. } => self.acked_bound(),
            _ => None,
        };
        let complete = |q: &PeerId| {
            let t = self.tracks.get(q);
            // Sent an image it may release its old copy for, and not based yet: not counted
            // (two peers must not both release on each other's account).
            let releasing = t.is_some_and(|t| t.superseding && t.applied == 0);
            *q != p
                && !releasing
                && (t.is_some_and(|t| !t.lost && t.resync.is_none() && t.applied >= 1 && t.applied >= self.acked_seq)
                    || bound.is_some_and(|b| {
                        !self.excluded.contains(q) && matches!(self.probes.get(q), Some(Some(h)) if (h.epoch, h.seq) >= b)
                    }))
        };
        self.peers.iter().filter(|q| complete(q)).count() >= self.majority
            && self.witness_set.iter().filter(|q| complete(q)).count() > self.witness_set.len() / 2
    }

    /// A state every acknowledged op is at or below, from the probe answers: with `k` of the
    /// witness set's `n` members answering with a copy, every acknowledged op was applied by a
    /// majority `m` of it, so at least `k - n + m` of the answers are at a state that holds
    /// it (a peer only leaves a state for a newer epoch's Base, whose source held it). So the
    /// `(k - n + m)`-th most advanced answer bounds them all; with only a majority answering it
    /// is the most advanced one (the source).
    fn acked_bound(&self) -> Option<(Epoch, u64)> {
        let mut states: Vec<(Epoch, u64)> = self
            .witness_set
            .iter()
            .filter(|q| !self.excluded.contains(q))
            .filter_map(|q| self.probes.get(q).copied().flatten())
            .map(|h| (h.epoch, h.seq))
            .collect();
        states.sort_unstable_by(|a, b| b.cmp(a));
        let (k, n, m) = (states.len(), self.witness_set.len(), self.witness_set.len() / 2 + 1);
        let idx = (k + m).checked_sub(n)?;
        if idx == 0 || idx > k {
            return None;
        }
        Some(states[idx - 1])
    }

    /// While basing: a peer whose image did not fit gets it again, allowed to release its old
    /// copy, once that became safe (or its back-off expired).
    fn retry_no_room(&mut self) {
        if !matches!(self.phase, Phase::Basing { .. }) {
            return;
        }
        let now = self.now_us;
        for p in self.peers.clone() {
            let t = &self.tracks[&p];
            let Some(at) = t.no_room else { continue };
            if t.applied > 0 || !t.lost {
                continue;
            }
            if now >= at || (!t.superseding && self.may_release(p)) {
                let t = self.tracks.get_mut(&p).unwrap();
                t.lost = false;
                t.no_room = None;
                self.send_base(p);
            }
        }
    }

    fn choose_source(&mut self) {
        let witnesses: Vec<(PeerId, Holding)> =
            self.probes.iter().filter(|(p, _)| !self.excluded.contains(p)).filter_map(|(&p, h)| h.map(|h| (p, h))).collect();
        let witness_majority = self.witness_set.len() / 2 + 1;
        let in_set = |p: &PeerId| self.witness_set.contains(p);
        if !self.initialized {
            // Nothing was ever acknowledged (the controller marks a file initialized before
            // its first write can be acknowledged): start empty once a majority is fenced.
            if self.probes.keys().filter(|p| in_set(p)).count() >= witness_majority && self.probes.keys().filter(|p| self.peers.contains(p)).count() >= self.majority {
                let initial = std::mem::take(&mut self.initial);
                self.start_base(None, initial);
            }
            return;
        }
        // A writer: peers that answered without a copy (or whose copy proved unusable) stay no
        // witness for this epoch — they promised it, so no older writer can give them one now,
        // and a newer opener fences us anyway. Once too many did, no majority of witnesses can
        // come: fail now, not at the driver's deadline. A reader promises nothing, so a live
        // writer may still re-base a peer that answered empty (or give a source that moved on a
        // new copy): it concludes the file is lost only when every peer answered without one.
        let empty = |p: &&PeerId| matches!(self.probes.get(*p), Some(None));
        let without_copy = if self.read_only {
            let n = self.witness_set.iter().filter(empty).count();
            if n == self.witness_set.len() {
                n
            } else {
                0
            }
        } else {
            self.witness_set.iter().filter(|p| empty(p) || self.excluded.contains(*p)).count()
        };
        if self.witness_set.len() - without_copy < witness_majority {
            self.fail(Failure::Lost { without_copy, peers: self.witness_set.len() });
            return;
        }
        if witnesses.iter().filter(|(p, _)| in_set(p)).count() < witness_majority {
            // Wait: a peer may still answer or come back; the driver's deadline turns a lasting
            // lack of witnesses into EIO. Never recover from fewer than a majority. (A new
            // member holding a copy got it from an earlier recovery: it may be the source.)
            return;
        }
        let (source, holding) = *witnesses.iter().max_by_key(|(p, h)| (h.epoch, h.seq, std::cmp::Reverse(*p))).unwrap();
        if self.known == Some(holding) {
            // The caller's copy is this very state: nothing to fetch or compare.
            self.matched_known = true;
            if self.read_only {
                self.size = holding.size;
                self.read_state = Some(holding);
                self.phase = Phase::Ready;
            } else {
                self.image_elided = true;
                self.start_base_sized(Some((source, holding)), Vec::new(), holding.size);
            }
            return;
        }
        if self.known.is_some() && self.local_hint.is_none() {
            // The known copy is not current: compare it rather than fetch everything.
            self.local_wanted = Some((source, holding));
            return;
        }
        self.start_fetch(source, holding);
    }

    /// Reads `source`'s image at `holding` (block checksums first when there is a local copy).
    fn start_fetch(&mut self, source: PeerId, holding: Holding) {
        if holding.size == 0 {
            self.fetched(source, holding, Vec::new());
            return;
        }
        // The claimed size is not trusted for an allocation (a lying peer could claim petabytes).
        let local = self.local_hint.take().unwrap_or_default();
        let sums_pending: BTreeSet<u64> = if local.is_empty() { BTreeSet::new() } else { (0..holding.size).step_by(MAX_SUMS_BYTES as usize).collect() };
        let sums: Vec<u64> = sums_pending.iter().copied().collect();
        self.phase = Phase::Fetching(Fetch {
            source,
            holding,
            image: Vec::with_capacity(holding.size.min(MAX_CHUNK_BYTES as u64) as usize),
            ahead: BTreeMap::new(),
            requested: 0,
            local,
            local_ok: BTreeSet::new(),
            sums_pending,
        });
        self.touch(source);
        for o in sums {
            self.out.push((source, self.sums(o)));
        }
        self.fill_fetch_window();
    }

    /// Requests chunks until [`FETCH_WINDOW_CHUNKS`] past the verified prefix are in flight or
    /// waiting in `ahead` (chunks taken from the local copy do not count). Nothing while block
    /// checksums are still awaited.
    fn fill_fetch_window(&mut self) {
        let Phase::Fetching(f) = &mut self.phase else { return };
        if !f.sums_pending.is_empty() {
            return;
        }
        let chunk = MAX_CHUNK_BYTES as u64;
        // Chunks taken from the local copy may have moved the prefix past what was requested.
        f.requested = f.requested.max(f.image.len() as u64);
        let mut pending = (f.image.len() as u64..f.requested).step_by(MAX_CHUNK_BYTES).filter(|o| !f.local_ok.contains(o)).count() as u64;
        let mut offsets = Vec::new();
        while pending < FETCH_WINDOW_CHUNKS && f.requested < f.holding.size {
            if !f.local_ok.contains(&f.requested) {
                offsets.push(f.requested);
                pending += 1;
            }
            f.requested += chunk;
        }
        let source = f.source;
        for o in offsets {
            self.out.push((source, self.fetch(o)));
        }
    }

    /// Extends the verified prefix with chunks that arrived or match the local copy; starts the
    /// Base once the image is complete, else keeps the window full.
    fn advance(&mut self) {
        let Phase::Fetching(f) = &mut self.phase else { return };
        let mut reused = 0;
        while (f.image.len() as u64) < f.holding.size {
            let at = f.image.len() as u64;
            if f.local_ok.remove(&at) {
                let n = f.chunk_len(at);
                f.image.extend_from_slice(&f.local[at as usize..at as usize + n]);
                reused += n as u64;
            } else if let Some(next) = f.ahead.remove(&at) {
                f.image.extend_from_slice(&next);
            } else {
                break;
            }
        }
        self.reused_bytes += reused;
        if f.image.len() as u64 == f.holding.size {
            let Phase::Fetching(f) = std::mem::replace(&mut self.phase, Phase::Probing) else { unreachable!() };
            self.fetched(f.source, f.holding, f.image);
        } else {
            self.fill_fetch_window();
        }
    }

    /// The source's image is complete: a writer bases the new epoch on it, a reader is done.
    fn fetched(&mut self, source: PeerId, holding: Holding, image: Vec<u8>) {
        if self.read_only {
            self.size = image.len() as u64;
            self.read_state = Some(holding);
            self.recovered = Some(image);
            self.phase = Phase::Ready;
        } else {
            self.start_base(Some((source, holding)), image);
        }
    }

    /// A reader's source answered at state `got`: true if that answer is handled here. A
    /// newer state means a writer elsewhere is live and the bytes gathered may mix two states:
    /// the fetch starts over at the newer state (it holds every op the older one did; a peer
    /// only moves forward). An older one is a late answer of an earlier round: ignored. (The
    /// same state with another size is a corrupt answer, left to the writer's checks.)
    fn reader_moved_on(&mut self, peer: PeerId, got: Holding) -> bool {
        let Phase::Fetching(f) = &self.phase else { return true };
        if peer != f.source {
            return true; // an earlier source's late answer
        }
        let (was, now) = ((f.holding.epoch, f.holding.seq), (got.epoch, got.seq));
        if now < was {
            return true;
        }
        if now == was {
            return false;
        }
        self.read_rounds += 1;
        if self.read_rounds > MAX_READ_ROUNDS {
            self.fail(Failure::KeptChanging { rounds: MAX_READ_ROUNDS });
            return true;
        }
        let Phase::Fetching(f) = std::mem::replace(&mut self.phase, Phase::Probing) else { unreachable!() };
        if !f.local.is_empty() {
            self.local_hint = Some(f.local);
        }
        self.start_fetch(peer, got);
        true
    }

    /// The source is corrupt, torn or changed under us: it is no witness; choose again (the
    /// local copy stays available to the next source).
    fn exclude_source(&mut self, peer: PeerId) {
        if let Phase::Fetching(f) = &mut self.phase {
            if !f.local.is_empty() {
                self.local_hint = Some(std::mem::take(&mut f.local));
            }
        }
        self.excluded.insert(peer);
        self.phase = Phase::Probing;
        self.choose_source();
    }

    /// The source's block checksums for a range: chunks of the local copy that match them in
    /// every block are taken from it; fetching starts once every range is answered.
    fn on_sums(&mut self, peer: PeerId, offset: u64, block_crcs: Vec<u32>, got: Holding) {
        if self.read_only && self.reader_moved_on(peer, got) {
            return;
        }
        let Phase::Fetching(f) = &mut self.phase else { return };
        if peer != f.source || !f.sums_pending.contains(&offset) {
            return; // a duplicate, stale or unrequested answer
        }
        let end = (offset + MAX_SUMS_BYTES).min(f.holding.size);
        if got != f.holding || block_crcs.len() as u64 != (end - offset).div_ceil(BLOCK_BYTES as u64) {
            self.exclude_source(peer);
            return;
        }
        f.sums_pending.remove(&offset);
        let size = f.holding.size as usize;
        for at in (offset..end).step_by(MAX_CHUNK_BYTES) {
            let first = ((at - offset) / BLOCK_BYTES as u64) as usize;
            let blocks = f.chunk_len(at).div_ceil(BLOCK_BYTES);
            let intact = (0..blocks).all(|i| {
                let lo = at as usize + i * BLOCK_BYTES;
                let hi = (lo + BLOCK_BYTES).min(size);
                hi <= f.local.len() && crc32c::crc32c(&f.local[lo..hi]) == block_crcs[first + i]
            });
            if intact {
                f.local_ok.insert(at);
            }
        }
        if f.sums_pending.is_empty() {
            self.touch(peer);
            self.advance();
        }
    }

    fn on_data(&mut self, peer: PeerId, offset: u64, data: Vec<u8>, block_crcs: Vec<u32>, got: Holding) {
        if self.read_only && self.reader_moved_on(peer, got) {
            return;
        }
        let Phase::Fetching(f) = &mut self.phase else { return };
        if peer != f.source
            || offset < f.image.len() as u64
            || offset >= f.requested
            || !offset.is_multiple_of(MAX_CHUNK_BYTES as u64)
            || f.ahead.contains_key(&offset)
            || f.local_ok.contains(&offset)
        {
            return; // a duplicate, stale or unrequested answer
        }
        let want_len = f.chunk_len(offset);
        let blocks_ok = got == f.holding
            && data.len() == want_len
            && block_crcs.len() == data.len().div_ceil(BLOCK_BYTES)
            && data.chunks(BLOCK_BYTES).zip(&block_crcs).all(|(b, &c)| crc32c::crc32c(b) == c);
        if !blocks_ok {
            // Corrupt, torn or changed under us: this replica is no witness; choose again.
            self.exclude_source(peer);
            return;
        }
        self.fetched_bytes += data.len() as u64;
        f.ahead.insert(offset, data);
        self.touch(peer);
        self.advance();
    }

    fn start_base(&mut self, source: Option<(PeerId, Holding)>, image: Vec<u8>) {
        let size = image.len() as u64;
        self.start_base_sized(source, image, size);
    }

    /// Bases the new epoch on `image` of `size` bytes (`image` is empty while elided).
    fn start_base_sized(&mut self, source: Option<(PeerId, Holding)>, image: Vec<u8>, size: u64) {
        self.size = size;
        self.next_seq = 1;
        for (&p, t) in self.tracks.iter_mut() {
            // A peer whose probe answer has not arrived yet (it raced the fetch) is asked to
            // keep its copy too: the Base names the exact state, so a peer that differs answers
            // NeedImage and gets the image then. (Sending it the image at once would stage a
            // second copy beside one it may hold already: a full region has no room for it.)
            let same = match (source, self.probes.get(&p)) {
                (Some((_, h)), Some(Some(ph))) => *ph == h && !self.excluded.contains(&p),
                (Some(_), None) => !self.excluded.contains(&p),
                _ => false,
            };
            t.needs_image = !same && size > 0;
        }
        self.phase = Phase::Basing { source, image };
        for p in self.peers.clone() {
            self.send_base(p);
        }
    }

    fn send_base(&mut self, p: PeerId) {
        let supersede = self.may_release(p);
        let Phase::Basing { source, image } = &self.phase else { return };
        let t = self.tracks.get_mut(&p).unwrap();
        t.empty = matches!(self.probes.get(&p), Some(None));
        if t.needs_image && self.image_elided {
            return; // sent once the driver gives the image (`wants_image`)
        }
        t.last_send_us = self.now_us;
        let size = self.size;
        // Peers keeping `from` do not check it (their copy is that state); it is the image's
        // checksum wherever the image is sent.
        let image_crc = crc32c::crc32c(image);
        let from = if t.needs_image || size == 0 { None } else { source.map(|(_, h)| (h.epoch, h.seq)) };
        if t.needs_image {
            let to = ImageTo { file: self.file, epoch: self.epoch, now_us: self.now_us, patch_min_bytes: self.cfg.patch_min_bytes, out: &mut self.out, sent: &mut self.image_bytes };
            if !push_image(to, p, t, 1, image, supersede) {
                return; // the Base follows the patch, once the peer's checksums are in
            }
        }
        let base = Op::Base { from, size, image_crc };
        self.tracks.get_mut(&p).unwrap().base = Some(base.clone());
        self.out.push((p, PeerRequest::Record { file: self.file, epoch: self.epoch, seq: 1, op: base }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::peer::PeerCore;
    use crate::proto::apply_op;

    /// Delivers every outgoing message to its peer and every reply back, until quiet.
    fn run(c: &mut FileClient, peers: &mut [PeerCore]) {
        loop {
            let out = c.take_outputs();
            if out.is_empty() {
                return;
            }
            for (p, req) in out {
                let rep = peers[p as usize - 1].reply_to(req);
                c.handle(Input::Reply { peer: p, reply: rep });
            }
        }
    }

    /// Writes `len` patterned bytes through a fresh 3-peer session; returns the content.
    fn fill(peers: &mut [PeerCore], len: usize) -> Vec<u8> {
        let mut c = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut c, peers);
        let content: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        for (i, chunk) in content.chunks(MAX_CHUNK_BYTES).enumerate() {
            c.submit(Op::write((i * MAX_CHUNK_BYTES) as u64, chunk.to_vec())).unwrap();
            run(&mut c, peers);
        }
        assert_eq!(c.acked_seq(), c.last_seq());
        content
    }

    #[test]
    fn recovery_fetches_a_bounded_window_of_chunks_and_reassembles_them_in_any_order() {
        let len = 11 * MAX_CHUNK_BYTES + 5000;
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let content = fill(&mut peers, len);
        let mut r = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        let mut max_in_flight = 0u64;
        let mut fetched: BTreeSet<u64> = BTreeSet::new();
        let mut in_flight: BTreeSet<u64> = BTreeSet::new();
        loop {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            let mut replies = Vec::new();
            for (p, req) in out {
                if let PeerRequest::Fetch { offset, .. } = req {
                    assert!(fetched.insert(offset), "chunk {offset} fetched twice");
                    in_flight.insert(offset);
                }
                replies.push((p, peers[p as usize - 1].reply_to(req)));
            }
            max_in_flight = max_in_flight.max(in_flight.len() as u64);
            // Deliver backwards: every chunk but the first of a batch arrives ahead of the prefix.
            for (p, rep) in replies.into_iter().rev() {
                if let PeerReply::Data { offset, .. } = &rep {
                    in_flight.remove(offset);
                }
                r.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(r.is_ready());
        assert_eq!(max_in_flight, FETCH_WINDOW_CHUNKS, "the window is used and bounded");
        assert_eq!(fetched.len(), len.div_ceil(MAX_CHUNK_BYTES));
        assert_eq!(r.take_recovered().unwrap(), content);
    }

    /// Recovers with `local` as the local copy; returns the content and the offsets fetched.
    fn recover_with_local(peers: &mut [PeerCore], epoch: Epoch, local: Vec<u8>) -> (Vec<u8>, Vec<u64>, (u64, u64)) {
        let mut r = FileClient::open(1, epoch, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0).with_local_copy(local);
        let mut fetched = Vec::new();
        loop {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                if let PeerRequest::Fetch { offset, .. } = req {
                    fetched.push(offset);
                }
                let rep = peers[p as usize - 1].reply_to(req);
                r.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(r.is_ready());
        let bytes = r.recovery_bytes();
        (r.take_recovered().unwrap(), fetched, bytes)
    }

    #[test]
    fn recovery_with_a_local_copy_fetches_only_the_chunks_it_lacks() {
        let chunk = MAX_CHUNK_BYTES;
        let len = 6 * chunk + 5000;
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let content = fill(&mut peers, len);
        // Intact copy: nothing fetched.
        let (got, fetched, (f, reused)) = recover_with_local(&mut peers, 2, content.clone());
        assert_eq!(got, content);
        assert!(fetched.is_empty(), "{fetched:?}");
        assert_eq!((f, reused), (0, len as u64));
        // One flipped byte in chunk 2, and the copy ends inside chunk 5: chunks 2, 5 and 6 are
        // fetched (a copy that is longer than the source's is cut to the source's size).
        let mut local = content.clone();
        local[2 * chunk + 4097] ^= 1;
        local.truncate(5 * chunk + 100);
        let (got, fetched, (f, reused)) = recover_with_local(&mut peers, 3, local);
        assert_eq!(got, content);
        assert_eq!(fetched, vec![2 * chunk as u64, 5 * chunk as u64, 6 * chunk as u64]);
        assert_eq!(f + reused, len as u64);
        let mut longer = content.clone();
        longer.extend_from_slice(b"unacknowledged tail");
        let (got, fetched, _) = recover_with_local(&mut peers, 4, longer);
        assert_eq!(got, content);
        assert!(fetched.is_empty(), "bytes past the source's size are not compared: {fetched:?}");
        // A copy of something else entirely: every chunk is fetched, the result is still exact.
        let (got, fetched, _) = recover_with_local(&mut peers, 5, vec![0xee; len]);
        assert_eq!(got, content);
        assert_eq!(fetched.len(), len.div_ceil(chunk));
    }

    #[test]
    fn a_reader_repairs_a_stale_copy_fences_nobody_and_follows_a_live_writer() {
        let chunk = MAX_CHUNK_BYTES;
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let mut w = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        let mut content: Vec<u8> = (0..3 * chunk + 100).map(|i| (i * 13 + i / 4096) as u8).collect();
        for (i, c) in content.chunks(chunk).enumerate() {
            w.submit(Op::write((i * chunk) as u64, c.to_vec())).unwrap();
            run(&mut w, &mut peers);
        }
        // A stale local copy: the first chunk only, then an older version of the second.
        let mut local = content[..chunk + 10].to_vec();
        local[chunk + 3] ^= 0xff;
        let mut r = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0).with_local_copy(local);
        let (mut fetched, mut appended) = (Vec::new(), false);
        loop {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                if let PeerRequest::Fetch { offset, epoch, .. } = req {
                    assert_eq!(epoch, READ_EPOCH);
                    fetched.push(offset);
                    if !appended {
                        // The writer goes on while the reader reads: the source moves forward.
                        appended = true;
                        let tail = vec![0xab; 5000];
                        w.submit(Op::write(content.len() as u64, tail.clone())).unwrap();
                        run(&mut w, &mut peers);
                        content.extend_from_slice(&tail);
                    }
                }
                let rep = peers[p as usize - 1].reply_to(req);
                r.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(r.is_ready(), "{:?}", r.failure());
        assert_eq!(r.take_recovered().unwrap(), content, "the newer state, whole");
        assert!(!fetched.contains(&0), "the intact first chunk is taken from the local copy: {fetched:?}");
        // The writer was not fenced: it goes on at its epoch.
        let s = w.submit(Op::write(0, b"still mine".to_vec())).unwrap();
        run(&mut w, &mut peers);
        assert!(w.failure().is_none() && w.acked_seq() >= s);
    }

    #[test]
    fn a_reader_with_a_known_current_copy_fetches_nothing_and_a_moved_state_fetches_only_what_differs() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let content = fill(&mut peers, 2 * MAX_CHUNK_BYTES + 77);
        let mut r = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0);
        run(&mut r, &mut peers);
        assert_eq!(r.take_recovered().unwrap(), content);
        let state = r.read_state().unwrap();
        // Same state: ready from the probes alone.
        let mut again = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0).with_known_state(state);
        let mut asked = Vec::new();
        loop {
            let out = again.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                asked.push(req.clone());
                let rep = peers[p as usize - 1].reply_to(req);
                again.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(again.is_ready() && again.matched_known(), "{:?}", again.failure());
        assert!(asked.iter().all(|q| matches!(q, PeerRequest::Probe { .. })), "only probes: {asked:?}");
        assert_eq!(again.read_state(), Some(state));
        // The file moved on (a writer appended): the known state no longer matches.
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        let mut now = w.take_recovered().unwrap();
        w.submit(Op::write(now.len() as u64, b"more".to_vec())).unwrap();
        run(&mut w, &mut peers);
        now.extend_from_slice(b"more");
        // The local copy is read and compared: only the last chunk (where the append is) is fetched.
        let mut moved = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0).with_known_state(state);
        run_with_copy(&mut moved, &mut peers, &content, &mut Vec::new());
        assert!(moved.is_ready() && !moved.matched_known());
        let last = (now.len() - 1) / MAX_CHUNK_BYTES * MAX_CHUNK_BYTES;
        assert_eq!(moved.recovery_bytes(), ((now.len() - last) as u64, last as u64));
        assert_eq!(moved.take_recovered().unwrap(), now);
    }

    /// Delivers everything, giving the local copy `local` whenever the client asks for it.
    fn run_with_copy(c: &mut FileClient, peers: &mut [PeerCore], local: &[u8], asked: &mut Vec<PeerRequest>) {
        loop {
            if c.wants_image() {
                c.handle(Input::Image(local.to_vec()));
            }
            if c.wants_local_copy() {
                c.handle(Input::LocalCopy(local.to_vec()));
            }
            if let Some(p) = c.wants_resync() {
                c.handle(Input::Resync { peer: p, image: local.to_vec() });
            }
            let out = c.take_outputs();
            if out.is_empty() {
                return;
            }
            for (p, req) in out {
                asked.push(req.clone());
                let rep = peers[p as usize - 1].reply_to(req);
                c.handle(Input::Reply { peer: p, reply: rep });
            }
        }
    }

    #[test]
    fn a_writer_with_a_known_current_copy_bases_without_the_bytes_and_reads_them_only_for_a_peer_that_lacks_them() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let mut w = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        let mut content: Vec<u8> = (0..2 * MAX_CHUNK_BYTES + 77).map(|i| (i * 13) as u8).collect();
        w.submit(Op::write(0, content.clone())).unwrap();
        run(&mut w, &mut peers);
        let state = w.committed_state().unwrap();
        assert_eq!(state.size, content.len() as u64);
        // Every peer holds that state: probes and Bases only, no bytes either way.
        let mut again = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0).with_known_state(state);
        let mut asked = Vec::new();
        run_with_copy(&mut again, &mut peers, &[], &mut asked);
        assert!(again.is_ready() && again.matched_known(), "{:?}", again.failure());
        assert!(asked.iter().all(|q| matches!(q, PeerRequest::Probe { .. } | PeerRequest::Record { op: Op::Base { from: Some(_), .. }, .. })), "{asked:?}");
        assert_eq!(again.take_recovered(), None, "the caller's copy is the content");
        assert_eq!(again.size(), content.len() as u64);
        again.submit(Op::write(content.len() as u64, b"tail".to_vec())).unwrap();
        run(&mut again, &mut peers);
        content.extend_from_slice(b"tail");
        let state = again.committed_state().unwrap();
        // Peer 3 lost its memory: the bytes are read once, for it alone, and it ends up current.
        peers[2] = PeerCore::new(64 << 20);
        let mut third = FileClient::open(1, 3, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0).with_known_state(state);
        let mut asked = Vec::new();
        run_with_copy(&mut third, &mut peers, &content, &mut asked);
        assert!(third.is_ready() && third.matched_known(), "{:?}", third.failure());
        assert!(asked.iter().all(|q| !matches!(q, PeerRequest::Fetch { .. } | PeerRequest::Sums { .. })), "nothing fetched");
        assert!(asked.iter().any(|q| matches!(q, PeerRequest::Stage { .. })), "the image went to peer 3");
        assert!(third.fully_replicated());
        // A later plain recovery reads exactly the content from any majority, peer 3 included.
        let mut check = FileClient::open(1, 4, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        peers[0] = PeerCore::new(64 << 20);
        run(&mut check, &mut peers);
        assert_eq!(check.take_recovered().unwrap(), content);
        // A known state that is not the peers' (another writer moved on): the local copy is
        // read and compared; only the chunk that differs is fetched.
        let mut stale = FileClient::open(1, 5, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0).with_known_state(state);
        check.submit(Op::write(0, b"X".to_vec())).unwrap();
        run(&mut check, &mut peers);
        run_with_copy(&mut stale, &mut peers, &content, &mut Vec::new());
        assert!(stale.is_ready() && !stale.matched_known());
        assert_eq!(stale.recovery_bytes(), (MAX_CHUNK_BYTES as u64, content.len() as u64 - MAX_CHUNK_BYTES as u64));
        let mut want = content.clone();
        want[0] = b'X';
        assert_eq!(stale.take_recovered().unwrap(), want);
    }

    /// Like `run`, but messages to the peers in `cut` are lost; wanted resyncs are served with
    /// `local` (the writer's copy).
    fn run_cut(c: &mut FileClient, peers: &mut [PeerCore], cut: &[PeerId], local: &[u8]) {
        loop {
            if let Some(p) = c.wants_resync() {
                c.handle(Input::Resync { peer: p, image: local[..c.size() as usize].to_vec() });
            }
            let out = c.take_outputs();
            if out.is_empty() {
                return;
            }
            for (p, req) in out {
                if !cut.contains(&p) {
                    let rep = peers[p as usize - 1].reply_to(req);
                    c.handle(Input::Reply { peer: p, reply: rep });
                }
            }
        }
    }

    fn image_of(peers: &mut [PeerCore], p: usize) -> Vec<u8> {
        let h = peers[p].holding(1).unwrap();
        let mut img = Vec::new();
        while (img.len() as u64) < h.size {
            match peers[p].reply_to(PeerRequest::Fetch { file: 1, epoch: READ_EPOCH, offset: img.len() as u64, len: MAX_CHUNK_BYTES as u32 }) {
                PeerReply::Data { data, .. } => img.extend_from_slice(&data),
                r => panic!("{r:?}"),
            }
        }
        img
    }

    #[test]
    fn a_lagging_peer_is_patched_with_the_blocks_it_lacks_and_an_empty_one_gets_the_whole_image() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let mut content = fill(&mut peers, 3 * MAX_CHUNK_BYTES + 1000);
        // Epoch 2 without peer 3: a block in the middle rewritten, 100 kB appended.
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run_cut(&mut w, &mut peers, &[3], &content);
        assert!(w.is_ready(), "{:?}", w.failure());
        for op in [Op::write(1_500_000, vec![9; 10]), Op::write(content.len() as u64, vec![7; 100_000])] {
            apply_op(&mut content, &op);
            w.submit(op).unwrap();
            run_cut(&mut w, &mut peers, &[3], &content);
        }
        assert_eq!(w.acked_seq(), w.last_seq());
        // Epoch 3 over all three: peer 3, at epoch 1, is patched, not sent 3 MB.
        let mut w = FileClient::open(1, 3, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run_cut(&mut w, &mut peers, &[], &content);
        assert!(w.fully_replicated(), "{:?}", w.failure());
        let sent = w.image_bytes();
        assert_eq!(sent.whole, 0, "{sent:?}");
        assert_eq!(sent.patched_images, content.len() as u64);
        assert!(sent.patch >= 100_000 && sent.patch <= 100_000 + 3 * BLOCK_BYTES as u64, "{sent:?}");
        assert_eq!(image_of(&mut peers, 2), content);
        // Mid-epoch: peer 3 falls behind the retransmit buffer (lost), then answers again at its
        // old state: resynced by a patch of what it missed.
        let cfg = ClientConfig { max_buffered_bytes: 64 * 1024, ..ClientConfig::default() };
        let mut w = FileClient::open(1, 4, vec![1, 2, 3], true, Vec::new(), cfg, 0);
        run_cut(&mut w, &mut peers, &[], &content);
        for i in 0..4u64 {
            let op = Op::write(content.len() as u64, vec![i as u8 + 1; 40_000]);
            apply_op(&mut content, &op);
            w.submit(op).unwrap();
            run_cut(&mut w, &mut peers, &[3], &content);
        }
        assert!(!w.fully_replicated());
        w.handle(Input::Tick { now_us: 10_000_000 });
        run_cut(&mut w, &mut peers, &[], &content);
        assert!(w.fully_replicated(), "{:?}", w.failure());
        let sent = w.image_bytes();
        assert_eq!(sent.whole, 0, "{sent:?}");
        assert!(sent.patch >= 160_000 && sent.patch <= 160_000 + 2 * BLOCK_BYTES as u64, "{sent:?}");
        assert_eq!(image_of(&mut peers, 2), content);
        // A peer that lost its memory holds nothing to patch: the whole image, no checksums asked.
        peers[2] = PeerCore::new(64 << 20);
        let mut w = FileClient::open(1, 5, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run_cut(&mut w, &mut peers, &[], &content);
        assert!(w.fully_replicated(), "{:?}", w.failure());
        assert_eq!(w.image_bytes(), ImageBytes { whole: content.len() as u64, patch: 0, patched_images: 0 });
        assert_eq!(image_of(&mut peers, 2), content);
    }

    #[test]
    fn a_patch_that_does_not_check_falls_back_to_the_whole_image() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let mut content = fill(&mut peers, MAX_CHUNK_BYTES);
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run_cut(&mut w, &mut peers, &[3], &content);
        let op = Op::write(content.len() as u64, vec![5; 5000]);
        apply_op(&mut content, &op);
        w.submit(op).unwrap();
        run_cut(&mut w, &mut peers, &[3], &content);
        // Peer 3's copy is corrupted at rest: its checksums still claim the old bytes, so the
        // patch leaves the bad byte in place; the Base's image checksum catches it.
        assert!(peers[2].corrupt(1, 12345));
        let mut w = FileClient::open(1, 3, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run_cut(&mut w, &mut peers, &[], &content);
        assert!(w.fully_replicated(), "{:?}", w.failure());
        let sent = w.image_bytes();
        assert_eq!(sent.whole, content.len() as u64, "{sent:?}");
        assert!(sent.patch > 0, "{sent:?}");
        assert_eq!(image_of(&mut peers, 2), content);
    }

    #[test]
    fn a_reader_of_a_file_that_never_stops_changing_fails_loudly() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let mut w = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        w.submit(Op::write(0, vec![1; 3 * MAX_CHUNK_BYTES])).unwrap();
        run(&mut w, &mut peers);
        let mut r = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0);
        let mut at = 3 * MAX_CHUNK_BYTES as u64;
        for _ in 0..1000 {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                // A write lands between every request and its answer.
                w.submit(Op::write(at, vec![2; 10])).unwrap();
                at += 10;
                run(&mut w, &mut peers);
                let rep = peers[p as usize - 1].reply_to(req);
                r.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert_eq!(r.failure(), Some(&Failure::KeptChanging { rounds: MAX_READ_ROUNDS }));
        assert!(w.failure().is_none());
    }

    #[test]
    fn a_corrupt_chunk_inside_the_window_excludes_the_source_and_recovery_uses_another() {
        let len = 5 * MAX_CHUNK_BYTES;
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(64 << 20)).collect();
        let content = fill(&mut peers, len);
        let mut r = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        let mut corrupted = None;
        loop {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                let mut rep = peers[p as usize - 1].reply_to(req);
                if let PeerReply::Data { offset, data, .. } = &mut rep {
                    if *offset == 3 * MAX_CHUNK_BYTES as u64 && corrupted.is_none() {
                        data[17] ^= 1;
                        corrupted = Some(p);
                    }
                }
                r.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        let bad = corrupted.expect("a chunk was corrupted");
        assert!(r.is_ready());
        assert!(r.excluded.contains(&bad));
        assert_eq!(r.take_recovered().unwrap(), content);
    }

    #[test]
    fn a_full_region_fails_the_write_loudly_and_never_acknowledges_it() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(100)).collect();
        let mut c = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut c, &mut peers);
        assert!(c.is_ready());
        let ok = c.submit(Op::write(0, vec![1; 60])).unwrap();
        run(&mut c, &mut peers);
        assert!(c.acked_seq() >= ok);
        let big = c.submit(Op::write(60, vec![2; 60])).unwrap();
        run(&mut c, &mut peers);
        assert!(matches!(c.failure(), Some(Failure::RegionFull { .. })), "{:?}", c.failure());
        assert!(c.acked_seq() < big, "the write that did not fit is never acknowledged");
        assert!(peers.iter().all(|p| p.holding(1).unwrap().size == 60), "nothing applied short");
        assert!(c.submit(Op::write(0, vec![3])).is_err(), "later writes fail too");
    }

    #[test]
    fn recovery_takes_the_most_advanced_member_of_a_majority_and_keeps_trailing_zeros() {
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(1 << 20)).collect();
        let mut c = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        run(&mut c, &mut peers);
        c.submit(Op::write(0, b"abc".to_vec())).unwrap();
        run(&mut c, &mut peers);
        // Only peers 1 and 2 get the next ops (peer 3 lags): acknowledged by a majority.
        let s1 = c.submit(Op::write(3, b"def".to_vec())).unwrap();
        let s2 = c.submit(Op::Truncate { size: 10 }).unwrap();
        for (p, req) in c.take_outputs() {
            if p != 3 {
                let rep = peers[p as usize - 1].reply_to(req);
                c.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(c.acked_seq() >= s2 && s2 > s1);
        drop(c);
        // Recovery hears from peer 3 (behind) and peer 2 (ahead) only.
        let mut r = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        loop {
            let out = r.take_outputs();
            if out.is_empty() {
                break;
            }
            for (p, req) in out {
                if p != 1 {
                    let rep = peers[p as usize - 1].reply_to(req);
                    r.handle(Input::Reply { peer: p, reply: rep });
                }
            }
        }
        assert!(r.is_ready());
        assert_eq!(r.take_recovered().unwrap(), b"abcdef\0\0\0\0".to_vec());
    }

    #[test]
    fn a_file_whose_peers_lost_it_fails_at_once_as_lost_and_a_minority_loss_recovers() {
        // Peers 2 and 3 restarted (memory empty); peer 1 still has a copy that may lack
        // acknowledged writes (they were on a majority, which a lone copy need not be part of).
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(1 << 20)).collect();
        let content = fill(&mut peers, 5000);
        peers[1] = PeerCore::new(1 << 20);
        peers[2] = PeerCore::new(1 << 20);
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        assert_eq!(w.failure(), Some(&Failure::Lost { without_copy: 2, peers: 3 }), "no waiting for a majority that cannot come");
        assert!(w.failure().unwrap().to_string().contains("nearlog reseed"), "the error names the way out");
        // A reader promises nothing (a live writer may still re-base the empty peers): it
        // waits while one peer holds a copy, and concludes the file is lost once none does.
        let mut r = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0);
        run(&mut r, &mut peers);
        assert!(r.failure().is_none() && !r.is_ready());
        peers[0] = PeerCore::new(1 << 20);
        let mut r = FileClient::reader(1, vec![1, 2, 3], Vec::new(), ClientConfig::default(), 0);
        run(&mut r, &mut peers);
        assert_eq!(r.failure(), Some(&Failure::Lost { without_copy: 3, peers: 3 }));
        // Only one peer lost it: a majority of witnesses remains, recovery goes on.
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(1 << 20)).collect();
        let content2 = fill(&mut peers, 5000);
        assert_eq!(content, content2);
        peers[0] = PeerCore::new(1 << 20);
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        run(&mut w, &mut peers);
        assert!(w.is_ready(), "{:?}", w.failure());
        assert_eq!(w.take_recovered().unwrap(), content);
        // One empty answer and one silent peer: still waiting (the silent one may come back).
        let mut peers: Vec<PeerCore> = (0..3).map(|_| PeerCore::new(1 << 20)).collect();
        fill(&mut peers, 5000);
        peers[0] = PeerCore::new(1 << 20);
        let mut w = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
        for (p, req) in w.take_outputs() {
            if p != 2 {
                let rep = peers[p as usize - 1].reply_to(req);
                w.handle(Input::Reply { peer: p, reply: rep });
            }
        }
        assert!(w.failure().is_none() && !w.is_ready());
    }

    /// The invariant checks can fail: a client whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut c = FileClient::open(1, 1, vec![1, 2, 3], false, Vec::new(), ClientConfig::default(), 0);
        c.check_invariants();
        c.acked_seq = 5; // acknowledged, yet never submitted
        let e = std::panic::catch_unwind(|| c.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(msg.contains("acknowledged ops were submitted"), "{msg}");
    }
}
