//! Tokio drivers of the peer and controller cores: TCP, `wire` frames, `wire::auth`.
//!
//! The peer's data path is batched: a connection thread reads straight into its input buffer,
//! decodes every frame already buffered, applies them to the core under one lock, and writes all
//! replies (encoded in place into one output buffer) with one `write` once the input is drained.
//! Per byte the peer only checks the frame's and the record's CRC32C and copies the record into
//! the region (the block checksums are computed over what it copies).
//!
//! Memory beyond the bytes held is bounded by named limits: per connection an input buffer of
//! [`READ_CHUNK_BYTES`] and pending replies flushed at [`MAX_REPLY_BATCH_BYTES`]; a connection
//! moving a large frame (an image chunk in, a fetched chunk out: up to `MAX_FRAME_BYTES`) grows
//! its buffers only while it holds one of [`MAX_LARGE_FRAMES`] slots shared by all connections;
//! at most [`MAX_PEER_CONNECTIONS`] connections; and the allocator set up by [`tune_allocator`].
//! Worst case beyond the held bytes: 256 × (32 + 64) KiB + 4 × ~4.2 MiB ≈ 41 MiB, plus the
//! process itself (~9 MiB).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::core::controller::{ControllerCore, CtlInput, CtlOutput};
use crate::driver::blocking::Conn;
use crate::store::MetaStore;
use crate::core::peer::{PeerCore, PeerInput};
use crate::proto::{CtlReply, CtlRequest, PeerReply, PeerRequest, MAX_FRAME_BYTES};

/// How often a peer reports its used bytes to the controller.
pub const HEARTBEAT_INTERVAL_MS: u64 = 1000;

/// Serves a log peer on `listener` until the task is dropped; registers with the controller at
/// `controller` (retrying until it answers) and heartbeats its used bytes.
pub async fn run_peer(listener: TcpListener, advertise: String, controller: String, secret: Arc<Vec<u8>>, region_bytes: u64) -> std::io::Result<()> {
    run_peer_as(listener, advertise, controller, secret, region_bytes, None).await
}

/// [`run_peer`] with an identity file: the id the controller gave this peer is kept in
/// `identity` and sent with every registration, so a restarted peer (memory empty) is known
/// as the same peer — even at another address — instead of a new one beside a dead one.
pub async fn run_peer_as(
    listener: TcpListener,
    advertise: String,
    controller: String,
    secret: Arc<Vec<u8>>,
    region_bytes: u64,
    identity: Option<std::path::PathBuf>,
) -> std::io::Result<()> {
    run_peer_leased(listener, advertise, controller, secret, region_bytes, identity, None).await
}

/// Where a peer keeps its liveness lease (`nearlog peer --store`): `live/peer/<id>` in the
/// control store the controllers run on, renewed while the peer runs.
#[derive(Clone, Debug)]
pub struct PeerLease {
    /// The control store (`etcd://...`): shared with the controllers.
    pub store_url: String,
    /// The cluster name in the store's keys (the controllers' `--store-cluster`).
    pub cluster: String,
    /// The cluster's identity (from the secret, as the controllers derive it).
    pub cluster_id: String,
    /// The lease's TTL: the controller finds the peer lost about this long after it died.
    pub ttl: Duration,
}

/// The wait before registering in the store again after a failure.
const LEASE_RETRY_INTERVAL: Duration = Duration::from_millis(200);

/// [`run_peer_as`], keeping a liveness lease in the control store when `lease` is given.
pub async fn run_peer_leased(
    listener: TcpListener,
    advertise: String,
    controller: String,
    secret: Arc<Vec<u8>>,
    region_bytes: u64,
    identity: Option<std::path::PathBuf>,
    lease: Option<PeerLease>,
) -> std::io::Result<()> {
    tune_allocator();
    // The id the controller gave this peer, for the lease task.
    let (id_tx, id_rx) = tokio::sync::watch::channel(None);
    if let Some(lease) = lease {
        tokio::spawn(keep_peer_lease(lease, advertise.clone(), id_rx));
    }
    let core = Arc::new(Mutex::new(PeerCore::new(region_bytes)));
    let mut known_as = match &identity {
        Some(path) => read_peer_id(path)?,
        None => None,
    };
    {
        let core = core.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            let mut peer_id = None;
            let mut returned = false;
            loop {
                let (used, files) = {
                    let c = core.lock().unwrap();
                    let mut files = c.files();
                    // The controller accepts a bounded list; the rest is reported next time
                    // after these are released.
                    files.truncate(crate::core::controller::MAX_HEARTBEAT_FILES);
                    (c.used_bytes(), files)
                };
                let req = match peer_id {
                    None => CtlRequest::RegisterPeer { addr: advertise.clone(), region_bytes, known_as },
                    Some(peer) => CtlRequest::PeerHeartbeat { peer, used_bytes: used, files },
                };
                match ctl_call(&controller, &secret, &req).await {
                    Ok(CtlReply::Registered { peer }) => {
                        tracing::info!(peer, %advertise, returning = known_as == Some(peer), "registered with the controller");
                        if let Some(path) = identity.as_deref().filter(|_| known_as != Some(peer)) {
                            // Kept before we serve as this id: a restart must come back as it.
                            match write_peer_id(path, peer) {
                                Ok(()) => known_as = Some(peer),
                                Err(e) => tracing::warn!("cannot keep peer id {peer} in {}: {e}", path.display()),
                            }
                        }
                        peer_id = Some(peer);
                        id_tx.send_replace(Some(peer));
                    }
                    Ok(CtlReply::Heartbeat { release, draining }) => {
                        let mut c = core.lock().unwrap();
                        for f in release {
                            let used = c.used_bytes();
                            c.handle(PeerInput::Release(f));
                            let freed = used - c.used_bytes();
                            tracing::info!(file = f, freed, "released a file placed elsewhere");
                        }
                        if draining && !returned && c.used_bytes() == 0 {
                            // Reclaimed: every file moved away. The region goes back to the host
                            // (its buffers are freed; no new file is placed here).
                            c.handle(PeerInput::SetRegionBytes(0));
                            returned = true;
                            tracing::info!(%advertise, "reclaimed: lent region returned");
                            println!("nearlog peer {advertise}: reclaimed, lent region returned");
                        }
                    }
                    Ok(other) => {
                        tracing::warn!(?other, "controller refused us; registering again");
                        peer_id = None;
                    }
                    Err(e) => tracing::warn!("controller {controller} unreachable: {e}"),
                }
                // Memory freed by releases, drops and truncates goes back to the system.
                release_free_memory();
                tokio::time::sleep(Duration::from_millis(HEARTBEAT_INTERVAL_MS)).await;
            }
        });
    }
    // Accept errors (out of descriptors) are logged and waited out: the listener outlives
    // any flood of connections.
    let what = format!("nearlog peer {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    wire::listen::serve(listener, what, move |sock, from| {
        let core = core.clone();
        let secret = secret.clone();
        async move {
            if let Err(e) = serve_peer_conn(sock, core, &secret).await {
                tracing::debug!(%from, "peer connection ended: {e}");
            }
        }
    })
    .await;
    Ok(()) // not reached: the accept loop runs until the task is dropped
}

/// Keeps the peer's registration `live/peer/<id>` in the control store under a lease, for the
/// id the controller gave it (registering again under a new lease when one is lost, and under
/// the new id when the controller gives another).
async fn keep_peer_lease(l: PeerLease, advertise: String, mut id_rx: tokio::sync::watch::Receiver<Option<crate::proto::PeerId>>) {
    let store = loop {
        match control::Store::open(&l.store_url, &l.cluster, &l.cluster_id).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!("cannot open the control store {} for the peer's lease: {e}; trying again", l.store_url);
                tokio::time::sleep(LEASE_RETRY_INTERVAL).await;
            }
        }
    };
    loop {
        let Some(id) = *id_rx.borrow_and_update() else {
            if id_rx.changed().await.is_err() {
                return;
            }
            continue;
        };
        let reg = match store.register("peer", &id.to_string(), &advertise, l.ttl).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("cannot register peer {id} in the control store: {e}; trying again");
                tokio::time::sleep(LEASE_RETRY_INTERVAL).await;
                continue;
            }
        };
        println!("nearlog peer {advertise}: registered as peer {id} in the control store (lease {:x}, TTL {} ms)", reg.lease(), l.ttl.as_millis());
        tokio::select! {
            why = reg.lost() => println!("nearlog peer {advertise}: lost its lease in the control store ({why}); registering again"),
            _ = async {
                while id_rx.changed().await.is_ok() {
                    if *id_rx.borrow() != Some(id) {
                        return;
                    }
                }
                std::future::pending::<()>().await
            } => {
                let _ = reg.deregister().await;
            }
        }
    }
}

/// The id kept in a peer's identity file (`None`: no file yet, a new peer).
pub fn read_peer_id(path: &std::path::Path) -> std::io::Result<Option<crate::proto::PeerId>> {
    match std::fs::read_to_string(path) {
        Ok(s) => s.trim().parse().map(Some).map_err(|e| std::io::Error::other(format!("peer identity file {} is corrupt ({e}): {s:?}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(std::io::Error::new(e.kind(), format!("cannot read peer identity file {}: {e}", path.display()))),
    }
}

/// Replaces a peer's identity file atomically (write temp, fsync, rename, fsync dir).
pub fn write_peer_id(path: &std::path::Path, id: crate::proto::PeerId) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(format!("{id}\n").as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// glibc's mmap threshold in a peer process: every allocation of at least this many bytes
/// (file images, staged images, fetch replies, grown connection buffers) is its own mapping.
pub const PEER_MMAP_THRESHOLD_BYTES: usize = 128 * 1024;
/// glibc malloc arenas in a peer process (the connection threads share them).
pub const PEER_MALLOC_ARENAS: usize = 2;

/// Sets up the allocator of a peer process so that its memory beyond the bytes it holds stays
/// small. With glibc's defaults the mmap threshold climbs with every large free (up to 32 MiB),
/// so log images that grow by appends end up inside the heap: each growth copies the image and
/// the old copy stays resident as free heap, and images freed by unlink or truncate stay in
/// per-thread arenas (measured: 60 MB held, 122 MB peak RSS). A fixed threshold keeps every
/// image in a mapping of its own — grown in place by `mremap` (no copy, nothing left behind)
/// and given back to the system when freed; a few arenas bound the per-thread caches.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before the peer allocates much.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, PEER_MMAP_THRESHOLD_BYTES as libc::c_int);
        libc::mallopt(libc::M_ARENA_MAX, PEER_MALLOC_ARENAS as libc::c_int);
    }
}

/// Gives free heap memory back to the system (after files were released; once per heartbeat).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator's own heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A client connection silent for this long is closed.
pub const PEER_IDLE_TIMEOUT_SECS: u64 = 600;

/// Most client connections a peer serves at once (one data-path thread each).
pub const MAX_PEER_CONNECTIONS: usize = 256;

static PEER_CONNECTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

async fn serve_peer_conn(sock: TcpStream, core: Arc<Mutex<PeerCore>>, secret: &[u8]) -> Result<(), wire::WireError> {
    use std::sync::atomic::Ordering;
    sock.set_nodelay(true)?;
    // TLS as this process's link setting wants it for the client's address, then the secret.
    let link = wire::link::accept_authenticated(sock, secret).await?;
    if PEER_CONNECTIONS.fetch_add(1, Ordering::SeqCst) >= MAX_PEER_CONNECTIONS {
        PEER_CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
        return Err(wire::WireError::Io(std::io::Error::other(format!("more than {MAX_PEER_CONNECTIONS} connections"))));
    }
    // The data path runs on its own thread with blocking I/O: a record's round trip is one
    // wake-up of this thread, with no hop through the async scheduler.
    let sock = blocking_conn(link)?;
    // A client that vanished without closing frees its thread after this long (a live but
    // idle client simply reconnects).
    sock.set_read_timeout(Some(Duration::from_secs(PEER_IDLE_TIMEOUT_SECS)))?;
    // A plain thread, not the runtime's blocking pool: shutting the runtime down (Ctrl-C)
    // must not wait for connected clients.
    let spawned = std::thread::Builder::new().name("nearlog-peer-conn".into()).spawn(move || {
        if batch_sched() {
            // SAFETY: a valid sched_param; pid 0 is this thread. Normal to batch needs no privilege.
            let ok = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &libc::sched_param { sched_priority: 0 }) } == 0;
            if !ok {
                tracing::debug!("SCHED_BATCH refused: {}", std::io::Error::last_os_error());
            }
        }
        if let Err(e) = serve_records(sock, &core) {
            tracing::debug!("peer connection ended: {e}");
        }
        PEER_CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(e) = spawned {
        PEER_CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
        return Err(e.into());
    }
    Ok(())
}

/// The blocking connection of a data-path thread from an accepted link: the TCP socket back in
/// blocking mode; a TLS session carries on in a `rustls::StreamOwned` (the handshake and the
/// secret exchange are done, and flushed, so nothing of the session is left in tokio's hands).
fn blocking_conn(link: wire::link::Link) -> Result<Conn, wire::WireError> {
    use wire::tls::tokio_rustls::TlsStream;
    let conn = match link {
        wire::link::Link::Plain(s) => Conn::Plain(s.into_std()?),
        wire::link::Link::Tls(t) => match *t {
            TlsStream::Server(t) => {
                let (io, session) = t.into_inner();
                Conn::TlsServer(Box::new(wire::tls::rustls::StreamOwned::new(session, io.into_std()?)))
            }
            TlsStream::Client(_) => return Err(wire::WireError::Tls("an accepted link is the client side of TLS".into())),
        },
    };
    conn.tcp().set_nonblocking(false)?;
    Ok(conn)
}

/// Bytes a client connection's input buffer holds (one `read` asks for what is free of it); a
/// larger frame grows it to that frame's size until the frame is applied.
pub const READ_CHUNK_BYTES: usize = 32 * 1024;
/// Replies are written out once this many bytes are pending: bounds a connection's output
/// buffer (a fetched chunk, up to `MAX_CHUNK_BYTES`, goes out on its own, under a large-frame
/// slot).
pub const MAX_REPLY_BATCH_BYTES: usize = 64 * 1024;
/// Connections that may hold a large frame at once (an input buffer grown past
/// [`READ_CHUNK_BYTES`], or a fetch being answered): each holds up to ~4.2 MiB meanwhile (the
/// frame, the decoded request or the reply, and its encoding).
pub const MAX_LARGE_FRAMES: usize = 4;
/// A connection that waits this long for a large-frame slot is closed (its client reconnects
/// and sends again).
pub const LARGE_FRAME_WAIT_MS: u64 = 10_000;

static LARGE_FRAMES: Mutex<usize> = Mutex::new(0);
static LARGE_FRAME_FREED: std::sync::Condvar = std::sync::Condvar::new();

/// One of the [`MAX_LARGE_FRAMES`] slots, given back on drop.
struct LargeFrameSlot;

impl LargeFrameSlot {
    fn acquire() -> Result<LargeFrameSlot, wire::WireError> {
        let deadline = std::time::Instant::now() + Duration::from_millis(LARGE_FRAME_WAIT_MS);
        let mut used = LARGE_FRAMES.lock().unwrap_or_else(|e| e.into_inner());
        while *used >= MAX_LARGE_FRAMES {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(wire::WireError::Io(std::io::Error::other(format!("no large-frame slot within {LARGE_FRAME_WAIT_MS} ms"))));
            }
            used = LARGE_FRAME_FREED.wait_timeout(used, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        *used += 1;
        Ok(LargeFrameSlot)
    }
}

impl Drop for LargeFrameSlot {
    fn drop(&mut self) {
        *LARGE_FRAMES.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        LARGE_FRAME_FREED.notify_one();
    }
}

/// Whether a batch of records of one file is answered with one cumulative ack (`batch`, the
/// default) or one ack per record (`each`): `UNDERSTUDY_NEARLOG_PEER_ACKS`, read once at start.
/// Either way the acks of a batch go out in one `write` as soon as the batch is applied.
fn coalesce_acks() -> bool {
    static POLICY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POLICY.get_or_init(|| !matches!(std::env::var("UNDERSTUDY_NEARLOG_PEER_ACKS").as_deref(), Ok("each")))
}

/// Whether connection threads run as SCHED_BATCH (`UNDERSTUDY_NEARLOG_PEER_SCHED=batch`; default
/// `normal`), read once at start. A batch thread woken by a record does not preempt the writer
/// on its CPU, so the writer's send to the next peer of its majority goes out at once. Measured
/// (ABBA, 5 pairs of `bench nearlog apps --quick --apps redis --clients 1,50`, load 15-18):
/// write+fsync p50 33.4-34.4 us against 34.8-37.0 us normal, but Redis c1 5.8-12.5k ops/s
/// against 8.3-16.3k and Redis c50 0.61-0.88x weak against 0.76-1.05x: not the default.
fn batch_sched() -> bool {
    static POLICY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POLICY.get_or_init(|| matches!(std::env::var("UNDERSTUDY_NEARLOG_PEER_SCHED").as_deref(), Ok("batch")))
}

/// How long a connection thread polls for the next request without sleeping after answering a
/// batch, when the previous two batches came within that time of each other:
/// `UNDERSTUDY_NEARLOG_PEER_SPIN_US` (default 0: block in `read` at once; at most 1000), read
/// once at start. A writer that writes back to back sends its next record within a few µs of
/// our ack; a thread that is still running takes it without the wake-up a sleeping one pays
/// (on a VM an idle exit and an interrupt: the same order as the round trip), at the cost of
/// up to that much CPU per batch.
fn peer_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("UNDERSTUDY_NEARLOG_PEER_SPIN_US").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        Duration::from_micros(us.min(1000))
    })
}

/// Polls `sock` for input without sleeping (yielding the CPU between polls) for up to `spin`.
fn spin_for_input(sock: &Conn, spin: Duration) {
    use std::os::fd::AsRawFd;
    let until = std::time::Instant::now() + spin;
    let mut fd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd, no timeout.
        if unsafe { libc::poll(&mut fd, 1, 0) } != 0 || std::time::Instant::now() >= until {
            return;
        }
        // SAFETY: no arguments.
        unsafe { libc::sched_yield() };
    }
}

/// Applies every complete frame in the input buffer under one lock, then answers them all with
/// one `write`. Per byte: the frame checksum, the record checksum, the copy into the region.
/// Over 100 lines on purpose: the read buffer, the core's lock held across a batch, the large
/// frame slot and the coalesced acks are one loop whose state crosses iterations.
fn serve_records(mut sock: Conn, core: &Mutex<PeerCore>) -> Result<(), wire::WireError> {
    use std::io::{Read, Write};
    const HDR: usize = wire::FRAME_HEADER_BYTES;
    // Unparsed input is buf[start..end]: `read` fills the buffer directly (no staging copy).
    let mut buf = vec![0u8; READ_CHUNK_BYTES];
    let (mut start, mut end) = (0usize, 0usize);
    let mut out: Vec<u8> = Vec::with_capacity(MAX_REPLY_BATCH_BYTES);
    // Held while this connection's buffers may be larger than the above (never while waiting
    // for it with the core locked: holders need the core to finish).
    let mut slot: Option<LargeFrameSlot> = None;
    // The last reply in `out`, if an Ack: its (file, epoch) and where its frame starts.
    let mut last_ack: Option<((crate::proto::FileId, crate::proto::Epoch), usize)> = None;
    let spin = peer_spin();
    // When the last two batches arrived: a connection spins only while its client writes back
    // to back (the gap between them within the spin), so an idle or slow one costs no CPU.
    let t0 = std::time::Instant::now();
    let mut arrivals = [t0, t0 + Duration::from_secs(1)];
    loop {
        if !spin.is_zero() && start == end && arrivals[1].duration_since(arrivals[0]) <= spin {
            spin_for_input(&sock, spin);
        }
        let n = match sock.read(&mut buf[end..]) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue, // a signal: read again
            r => r?,
        };
        if n == 0 {
            return Err(wire::WireError::Closed);
        }
        end += n;
        if !spin.is_zero() {
            arrivals = [arrivals[1], std::time::Instant::now()];
        }
        let mut c = None;
        while end - start >= HDR {
            let header: [u8; HDR] = buf[start..start + HDR].try_into().unwrap();
            let (len, want) = wire::parse_header(&header, MAX_FRAME_BYTES)?;
            if end - start < HDR + len {
                if buf.len() - start < HDR + len {
                    // Make room for the whole frame (at most MAX_FRAME_BYTES plus a header).
                    buf.copy_within(start..end, 0);
                    end -= start;
                    start = 0;
                    if buf.len() < HDR + len {
                        if slot.is_none() {
                            drop(c.take());
                            slot = Some(LargeFrameSlot::acquire()?);
                        }
                        buf.resize(HDR + len, 0);
                    }
                }
                break;
            }
            let payload = &buf[start + HDR..start + HDR + len];
            let got = crc32c::crc32c(payload);
            if got != want {
                return Err(wire::WireError::Checksum { got, want });
            }
            let req: PeerRequest = wire::decode_payload(payload)?;
            start += HDR + len;
            if matches!(req, PeerRequest::Fetch { .. }) && slot.is_none() {
                // Its answer is up to a chunk: flush what is pending, answer it under a slot.
                drop(c.take());
                if !out.is_empty() {
                    sock.write_all(&out)?;
                    out.clear();
                    last_ack = None;
                }
                slot = Some(LargeFrameSlot::acquire()?);
            }
            let rep: PeerReply = c.get_or_insert_with(|| core.lock().unwrap()).reply_to(req);
            // Acks are cumulative: an Ack that follows one for the same file and epoch replaces
            // it (a batch of records costs the client one ack to decode, not one per record).
            let ack_of = match &rep {
                PeerReply::Ack { file, epoch, .. } => Some((*file, *epoch)),
                _ => None,
            };
            if let Some((_, at)) = last_ack.filter(|(k, _)| Some(*k) == ack_of && coalesce_acks()) {
                out.truncate(at);
            }
            let at = out.len();
            crate::driver::blocking::encode_into(&rep, &mut out)?;
            last_ack = ack_of.map(|k| (k, at));
            if out.len() >= MAX_REPLY_BATCH_BYTES {
                c = None; // other connections go on while this one writes
                sock.write_all(&out)?;
                out.clear();
                last_ack = None;
            }
        }
        drop(c);
        if start == end {
            (start, end) = (0, 0);
            if buf.len() > READ_CHUNK_BYTES {
                buf = vec![0u8; READ_CHUNK_BYTES];
            }
        } else if end == buf.len() {
            // A partial header at the very end: move it to the front.
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
        }
        if !out.is_empty() {
            sock.write_all(&out)?;
            out.clear();
        }
        last_ack = None;
        if out.capacity() > 2 * MAX_REPLY_BATCH_BYTES {
            out = Vec::with_capacity(MAX_REPLY_BATCH_BYTES);
        }
        if buf.len() <= READ_CHUNK_BYTES {
            slot = None; // both buffers are back to their small size
        }
    }
}

/// One controller call over a fresh authenticated connection (peers and tools).
/// `addr` may list several controllers separated by commas: the first that accepts is asked
/// (only the leader listens); one round, no waiting (peers call again at their next heartbeat).
pub async fn ctl_call(addr: &str, secret: &[u8], req: &CtlRequest) -> Result<CtlReply, wire::WireError> {
    let mut last = None;
    for a in addr.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        match ctl_connect(a, secret).await {
            Ok(mut s) => {
                wire::write_msg(&mut s, req).await?;
                s.flush().await?;
                return wire::read_msg(&mut s, MAX_FRAME_BYTES).await;
            }
            Err(e) => last = Some(wire::WireError::Io(std::io::Error::other(format!("{a}: {e}")))),
        }
    }
    Err(last.unwrap_or_else(|| wire::WireError::Decode(format!("no controller address in {addr:?}"))))
}

async fn ctl_connect(addr: &str, secret: &[u8]) -> Result<wire::link::Link, wire::WireError> {
    let s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| wire::WireError::Io(std::io::Error::other("connect timed out")))??;
    let mut s = wire::link::connect(s, wire::link::process()?).await?;
    wire::auth::connect(&mut s, secret).await?;
    Ok(s)
}

/// How long a mover started by the controller for a lost peer's file may take before it is
/// given up (the next tick starts another).
pub const AUTO_MOVE_DEADLINE_MS: u64 = 60_000;
/// Longest time between two ticks of the controller's clock (it ticks 4 times per lease).
pub const MAX_TICK_INTERVAL_MS: u64 = 500;

/// Serves the controller on `listener` until the task is dropped; ticks its clock (peer
/// leases) and runs the moves it asks for (lost peers replaced).
pub async fn run_controller<S: MetaStore + 'static>(listener: TcpListener, core: ControllerCore<S>, secret: Arc<Vec<u8>>) -> std::io::Result<()> {
    run_controller_with(listener, core, secret, None).await
}

/// How often the controller reads the peers' leases from the control store.
pub const PEER_LEASES_READ_INTERVAL: Duration = Duration::from_millis(200);

/// [`run_controller`], reading the peers' liveness leases from `leases` (the control store the
/// controller leads on) every [`PEER_LEASES_READ_INTERVAL`] for the core
/// ([`CtlInput::Leases`]). A read that fails feeds nothing: a store out of reach says nothing
/// about the peers (the controller's own election lease decides whether it goes on).
pub async fn run_controller_with<S: MetaStore + 'static>(
    listener: TcpListener,
    core: ControllerCore<S>,
    secret: Arc<Vec<u8>>,
    leases: Option<control::Store>,
) -> std::io::Result<()> {
    let core = Arc::new(Mutex::new(core));
    let start = std::time::Instant::now();
    let now_ms = move || start.elapsed().as_millis() as u64;
    // The movers talk to this controller like any client does.
    let mut me = listener.local_addr()?;
    if me.ip().is_unspecified() {
        me.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let me = me.to_string();
    let lease = core.lock().unwrap().peer_lease_ms();
    if lease > 0 {
        let (core, secret, me) = (core.clone(), secret.clone(), me.clone());
        tokio::spawn(async move {
            let tick = Duration::from_millis((lease / 4).clamp(1, MAX_TICK_INTERVAL_MS));
            loop {
                tokio::time::sleep(tick).await;
                let outs = {
                    let mut c = core.lock().unwrap();
                    c.handle(now_ms(), CtlInput::Tick);
                    c.take_outputs()
                };
                for o in outs {
                    carry_out(o, &core, &me, &secret, now_ms);
                }
            }
        });
    }
    if let Some(store) = leases {
        let (core, secret, me) = (core.clone(), secret.clone(), me.clone());
        tokio::spawn(async move {
            let prefix = store.prefix("live", "peer");
            loop {
                match store.list(&prefix).await {
                    Ok(kvs) => {
                        let live = kvs.iter().filter_map(|kv| kv.key[prefix.len()..].parse().ok().map(|id| (id, kv.lease))).collect();
                        let outs = {
                            let mut c = core.lock().unwrap();
                            c.handle(now_ms(), CtlInput::Leases { live });
                            c.take_outputs()
                        };
                        for o in outs {
                            carry_out(o, &core, &me, &secret, now_ms);
                        }
                    }
                    Err(e) => tracing::warn!("cannot read the peers' leases: {e}"),
                }
                tokio::time::sleep(PEER_LEASES_READ_INTERVAL).await;
            }
        });
    }
    let what = format!("nearlog controller {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    wire::listen::serve(listener, what, move |sock, from| {
        let core = core.clone();
        let secret = secret.clone();
        async move {
            let res: Result<(), wire::WireError> = async {
                let mut sock = wire::link::accept_authenticated(sock, &secret).await?;
                loop {
                    let req: CtlRequest = wire::read_msg(&mut sock, MAX_FRAME_BYTES).await?;
                    tracing::debug!(?req, "controller request");
                    // The core persists (fsync) inside the lock: changes are serialised.
                    let outs = {
                        let mut c = core.lock().unwrap();
                        c.handle(now_ms(), CtlInput::Request(req));
                        c.take_outputs()
                    };
                    let mut rep = None;
                    for o in outs {
                        match o {
                            CtlOutput::Reply(r) => rep = Some(r),
                            // A request only renews leases; log what it says.
                            other => log_output(&other),
                        }
                    }
                    let rep = rep.expect("a request gets one reply");
                    wire::write_msg(&mut sock, &rep).await?;
                    sock.flush().await?;
                }
            }
            .await;
            if let Err(e) = res {
                tracing::debug!(%from, "controller connection ended: {e}");
            }
        }
    })
    .await;
    Ok(()) // not reached: the accept loop runs until the task is dropped
}

/// Logs a controller output (stdout: an operator watching the controller sees each loss,
/// replacement and refusal).
fn log_output(o: &CtlOutput) {
    match o {
        CtlOutput::Reply(_) => {}
        CtlOutput::PeerLost { peer, silent_ms } => {
            tracing::warn!(peer, silent_ms, "log peer lost (silent past its lease)");
            println!("nearlog controller: peer {peer} lost: silent for {silent_ms} ms, past its lease");
        }
        CtlOutput::PeerBack { peer } => println!("nearlog controller: peer {peer} is back (files placed elsewhere meanwhile are released)"),
        CtlOutput::Move { key, lost, to } if lost == to => println!("nearlog controller: moving {key} off lost peer {lost} again"),
        CtlOutput::Move { key, lost, to } => println!("nearlog controller: replacing lost peer {lost} by peer {to} for {key}"),
        CtlOutput::CannotReplace { peer, key, reason } => {
            tracing::warn!(peer, %key, %reason, "cannot replace a lost log peer");
            println!("nearlog controller: {key} stays on lost peer {peer}: {reason}");
        }
        CtlOutput::Error(e) => {
            tracing::error!("{e}");
            println!("nearlog controller: {e}");
        }
    }
}

/// Carries out one output of a tick: a move runs on a blocking thread (the mover of `nearlog
/// reclaim`) and reports its end back to the core.
fn carry_out<S: MetaStore + 'static>(o: CtlOutput, core: &Arc<Mutex<ControllerCore<S>>>, me: &str, secret: &Arc<Vec<u8>>, now_ms: impl Fn() -> u64 + Send + 'static) {
    log_output(&o);
    let CtlOutput::Move { key, lost, .. } = o else { return };
    let (core, me, secret) = (core.clone(), me.to_string(), secret.clone());
    tokio::task::spawn_blocking(move || {
        let t0 = std::time::Instant::now();
        let deadline = t0 + Duration::from_millis(AUTO_MOVE_DEADLINE_MS);
        let res = crate::driver::mover::move_file(&me, &secret, &key, deadline);
        let ok = res.is_ok();
        match res {
            Ok(how) => println!("nearlog controller: {key} re-replicated off lost peer {lost} ({how:?}, {} ms)", t0.elapsed().as_millis()),
            Err(e) => println!("nearlog controller: moving {key} off lost peer {lost} failed (tried again at the next tick): {e}"),
        }
        let mut c = core.lock().unwrap();
        c.handle(now_ms(), CtlInput::MoveEnded { key, ok });
        for o in c.take_outputs() {
            log_output(&o);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_frame_slots_are_bounded_and_handed_on() {
        let held: Vec<LargeFrameSlot> = (0..MAX_LARGE_FRAMES).map(|_| LargeFrameSlot::acquire().unwrap()).collect();
        let got = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let g = got.clone();
        let waiter = std::thread::spawn(move || {
            let slot = LargeFrameSlot::acquire().unwrap();
            g.store(true, std::sync::atomic::Ordering::SeqCst);
            drop(slot);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!got.load(std::sync::atomic::Ordering::SeqCst), "a slot beyond the limit was handed out");
        drop(held);
        waiter.join().unwrap();
        assert!(got.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(*LARGE_FRAMES.lock().unwrap(), 0);
    }
}
