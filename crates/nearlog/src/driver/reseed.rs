//! Re-seeding a log file whose peers lost it (blocking, std-only; `understudy nearlog reseed`).
//!
//! A log peer keeps files in memory only, so when every peer of a file restarts (a restart of
//! `nearlog up`, a power loss of the peer hosts) no majority can vouch for the file's
//! acknowledged writes: its opens fail with [`Failure::Lost`]. What is left is the local copy
//! on the application's machine (SplitFT's bulk copy on storage), which holds every write the
//! application made there — but the cluster cannot know whether that copy is complete (a
//! machine that crashed loses unsynced page cache). Only the operator can accept it; this is
//! the command that does, and it refuses a file whose peers still hold it unless forced.
//!
//! Steps: verify (a reader at the read epoch, fencing nobody) that the peers lost the file;
//! the controller places it on live peers at a new epoch, not initialized
//! ([`CtlRequest::Reseed`]); a writer at that epoch bases it on the local copy on a majority;
//! the controller marks it initialized. Every older writer is fenced by the new epoch, and
//! the old copies are never read again (a peer only serves the epoch it was based at).

use std::time::{Duration, Instant};

use crate::core::file_client::{ClientConfig, Failure, FileClient};
use crate::driver::mover::{ctl_call, Driver};
use crate::proto::{CtlReply, CtlRequest, Epoch, PeerAddr, PeerId};

/// How long the check that the peers lost a file waits for them: a peer that does not answer
/// in this time may be down or gone; the operator decides (`force`).
pub const RESEED_CHECK_MS: u64 = 5000;

/// What a re-seed did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reseeded {
    pub epoch: Epoch,
    pub peers: Vec<PeerId>,
    pub bytes: u64,
}

/// Re-seeds `key` from `local` (the local copy, read by the caller). Without `force`, only a
/// file whose peers answered that they lost it ([`Failure::Lost`]) is re-seeded.
pub fn reseed(controller: &str, secret: &[u8], key: &str, local: impl FnOnce() -> std::io::Result<Vec<u8>>, force: bool, deadline: Instant) -> Result<Reseeded, String> {
    let ids = |v: &[PeerAddr]| v.iter().map(|p| p.id).collect::<Vec<_>>();
    let g = match ctl_call(controller, secret, &CtlRequest::Lookup { key: key.to_string() })? {
        CtlReply::Found(Some(g)) => g,
        CtlReply::Found(None) => return Err(format!("{key} is not a replicated log file (the controller has no record of it)")),
        other => return Err(format!("unexpected answer to Lookup: {other:?}")),
    };
    if !force {
        let mut d = Driver::new(secret);
        d.learn(&g);
        let mut r = FileClient::reader(g.file, ids(&g.peers), ids(&g.recover_from), ClientConfig::default(), d.now_us());
        let until = Instant::now() + Duration::from_millis(RESEED_CHECK_MS);
        match d.run(&mut r, until.min(deadline), |c| c.is_ready()) {
            Err(Failure::Lost { .. }) => {}
            Ok(()) => {
                return Err(format!(
                    "the log peers still hold {key} (a majority vouches for its content, which the application recovers at its next open): \
                     re-seeding would replace it with the local copy; pass --force to do that anyway"
                ))
            }
            Err(Failure::NoMajority) => {
                return Err(format!(
                    "the log peers of {key} ({:?}) did not answer within {RESEED_CHECK_MS} ms: they may be down, not gone; \
                     if they are gone for good, pass --force to re-seed from the local copy",
                    g.peers.iter().map(|p| &p.addr).collect::<Vec<_>>()
                ))
            }
            Err(e) => return Err(format!("checking that the peers lost {key}: {e}; pass --force to re-seed anyway")),
        }
    }
    let image = local().map_err(|e| format!("cannot read the local copy of {key}: {e}"))?;
    let g = match ctl_call(controller, secret, &CtlRequest::Reseed { key: key.to_string() })? {
        CtlReply::Granted(g) => g,
        other => return Err(format!("unexpected answer to Reseed: {other:?}")),
    };
    let bytes = image.len() as u64;
    let mut d = Driver::new(secret);
    d.learn(&g);
    // Not initialized: the epoch is based on `image` once a majority is fenced.
    let mut c = FileClient::open(g.file, g.epoch, ids(&g.peers), false, image, ClientConfig::default(), d.now_us());
    d.run(&mut c, deadline, |c| c.is_ready()).map_err(|e| format!("re-seeding {key} (epoch {}): {e}", g.epoch))?;
    ctl_call(controller, secret, &CtlRequest::Initialized { key: key.to_string(), epoch: g.epoch })
        .map_err(|e| format!("re-seeding {key}: the peers hold it at epoch {}, but: {e}", g.epoch))?;
    // The rest of the peers get the image too (a majority already has it; an open re-bases a
    // peer still missing it).
    let _ = d.run(&mut c, deadline.min(Instant::now() + Duration::from_secs(5)), |c| c.fully_replicated());
    Ok(Reseeded { epoch: g.epoch, peers: ids(&g.peers), bytes })
}
