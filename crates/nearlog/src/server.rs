//! Tokio drivers of the peer and controller cores: TCP, `wire` frames, `wire::auth`.
//!
//! The peer's data path is batched: a connection task decodes every frame already buffered,
//! applies them to the core under one lock, and writes all replies with one flush once the input
//! buffer is drained. Per byte the peer only checks the record's CRC32C and copies it into the
//! region (the block checksums are computed over what it copies).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use crate::controller::{ControllerCore, MetaStore};
use crate::peer::PeerCore;
use crate::proto::{CtlReply, CtlRequest, PeerReply, PeerRequest, MAX_FRAME_BYTES};

/// How often a peer reports its used bytes to the controller.
pub const HEARTBEAT_INTERVAL_MS: u64 = 1000;

/// Serves a log peer on `listener` until the task is dropped; registers with the controller at
/// `controller` (retrying until it answers) and heartbeats its used bytes.
pub async fn run_peer(listener: TcpListener, advertise: String, controller: String, secret: Arc<Vec<u8>>, region_bytes: u64) -> std::io::Result<()> {
    let core = Arc::new(Mutex::new(PeerCore::new(region_bytes)));
    {
        let core = core.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            let mut peer_id = None;
            let mut returned = false;
            loop {
                let (used, files) = {
                    let c = core.lock().unwrap();
                    (c.used_bytes(), c.files())
                };
                let req = match peer_id {
                    None => CtlRequest::RegisterPeer { addr: advertise.clone(), region_bytes },
                    Some(peer) => CtlRequest::PeerHeartbeat { peer, used_bytes: used, files },
                };
                match ctl_call(&controller, &secret, &req).await {
                    Ok(CtlReply::Registered { peer }) => {
                        tracing::info!(peer, %advertise, "registered with the controller");
                        peer_id = Some(peer)
                    }
                    Ok(CtlReply::Heartbeat { release, draining }) => {
                        let mut c = core.lock().unwrap();
                        for f in release {
                            let freed = c.release(f);
                            tracing::info!(file = f, freed, "released a file placed elsewhere");
                        }
                        if draining && !returned && c.used_bytes() == 0 {
                            // Reclaimed: every file moved away. The region goes back to the host
                            // (its buffers are freed; no new file is placed here).
                            c.set_region_bytes(0);
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
                tokio::time::sleep(Duration::from_millis(HEARTBEAT_INTERVAL_MS)).await;
            }
        });
    }
    loop {
        let (sock, from) = listener.accept().await?;
        let core = core.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_peer_conn(sock, core, &secret).await {
                tracing::debug!(%from, "peer connection ended: {e}");
            }
        });
    }
}

async fn serve_peer_conn(mut sock: TcpStream, core: Arc<Mutex<PeerCore>>, secret: &[u8]) -> Result<(), wire::WireError> {
    sock.set_nodelay(true)?;
    wire::auth::accept(&mut sock, secret).await?;
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    let mut w = BufWriter::with_capacity(1 << 16, w);
    loop {
        let req: PeerRequest = wire::read_msg(&mut r, MAX_FRAME_BYTES).await?;
        let mut replies = vec![core.lock().unwrap().handle(req)];
        // Batch: everything already buffered is applied before one flush.
        while r.buffer().len() >= wire::FRAME_HEADER_BYTES {
            let header: [u8; 8] = r.buffer()[..8].try_into().unwrap();
            let (len, _) = wire::parse_header(&header, MAX_FRAME_BYTES)?;
            if r.buffer().len() < 8 + len {
                break;
            }
            let req: PeerRequest = wire::read_msg(&mut r, MAX_FRAME_BYTES).await?;
            replies.push(core.lock().unwrap().handle(req));
        }
        for rep in &replies {
            wire::write_msg::<PeerReply, _>(&mut w, rep).await?;
        }
        w.flush().await?;
    }
}

/// One controller call over a fresh authenticated connection (peers and tools).
pub async fn ctl_call(addr: &str, secret: &[u8], req: &CtlRequest) -> Result<CtlReply, wire::WireError> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| wire::WireError::Io(std::io::Error::other("connect timed out")))??;
    wire::auth::connect(&mut s, secret).await?;
    wire::write_msg(&mut s, req).await?;
    s.flush().await?;
    wire::read_msg(&mut s, MAX_FRAME_BYTES).await
}

/// Serves the controller on `listener` until the task is dropped.
pub async fn run_controller<S: MetaStore + 'static>(listener: TcpListener, core: ControllerCore<S>, secret: Arc<Vec<u8>>) -> std::io::Result<()> {
    let core = Arc::new(Mutex::new(core));
    loop {
        let (mut sock, from) = listener.accept().await?;
        let core = core.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            let res: Result<(), wire::WireError> = async {
                sock.set_nodelay(true)?;
                wire::auth::accept(&mut sock, &secret).await?;
                loop {
                    let req: CtlRequest = wire::read_msg(&mut sock, MAX_FRAME_BYTES).await?;
                    tracing::debug!(?req, "controller request");
                    // The core persists (fsync) inside the lock: changes are serialised.
                    let rep = core.lock().unwrap().handle(req);
                    wire::write_msg(&mut sock, &rep).await?;
                    sock.flush().await?;
                }
            }
            .await;
            if let Err(e) = res {
                tracing::debug!(%from, "controller connection ended: {e}");
            }
        });
    }
}
