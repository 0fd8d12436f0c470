//! The failover agent's protocol: what the monitor ([`super::RemotePool`]) asks the agent of a
//! host ([`super::server`]) and what it answers. Imported by both, never by each other.
//!
//! One request per frame, one reply per frame; a frame is a 4-byte big-endian length and that
//! many bytes of JSON, at most [`MAX_AGENT_FRAME_BYTES`]. Every connection starts with the
//! cluster's challenge-response handshake ([`wire::auth`]): an agent starts and kills
//! applications, so it obeys only who knows the cluster secret. Every operation is idempotent
//! (the [`crate::pool::InstancePool`] contract): a monitor that takes over repeats whatever its
//! predecessor may or may not have finished.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::pool::PoolError;
use crate::proto::InstanceId;
use crate::spec::AppSpec;

/// Largest frame either side sends or accepts: a request carries at most an application's
/// command and environment, far below this.
pub const MAX_AGENT_FRAME_BYTES: usize = 64 * 1024;

/// Length prefix of a frame.
pub const FRAME_HEADER_BYTES: usize = 4;

/// The kind agents register under in the control store ([`control::Store::register`]): the
/// key `/understudy/<cluster>/live/failover-agent/<host>` holds the agent's address while its
/// lease is renewed, and disappears when its host dies.
pub const AGENT_KIND: &str = "failover-agent";

/// Longest application name (a directory under the agent's state directory).
pub const MAX_APP_NAME_BYTES: usize = 64;

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AgentRequest {
    /// Start instance `id` of application `app` on `volume` (or report the running one).
    /// `mkfs_first`: instance 1 makes the file system (as the spec's `mkfs`).
    Start { app: String, id: InstanceId, volume: String, spec: AppSpec, mkfs_first: bool },
    /// Kill the whole instance and detach its volume (the monitor's fence). Final for `id`.
    Kill { app: String, id: InstanceId },
    /// Stop the application cleanly, then detach.
    Stop { app: String, id: InstanceId },
    /// A crash (fault injection): the disk cut off, the application SIGKILLed.
    Crash { app: String, id: InstanceId },
    Pause { app: String, id: InstanceId, paused: bool },
    Cut { app: String, id: InstanceId, cut: bool },
    /// Where the instance is reached, if it runs here.
    Address { app: String, id: InstanceId },
}

impl AgentRequest {
    pub fn app(&self) -> &str {
        match self {
            AgentRequest::Start { app, .. }
            | AgentRequest::Kill { app, .. }
            | AgentRequest::Stop { app, .. }
            | AgentRequest::Crash { app, .. }
            | AgentRequest::Pause { app, .. }
            | AgentRequest::Cut { app, .. }
            | AgentRequest::Address { app, .. } => app,
        }
    }

    pub fn id(&self) -> InstanceId {
        match self {
            AgentRequest::Start { id, .. }
            | AgentRequest::Kill { id, .. }
            | AgentRequest::Stop { id, .. }
            | AgentRequest::Crash { id, .. }
            | AgentRequest::Pause { id, .. }
            | AgentRequest::Cut { id, .. }
            | AgentRequest::Address { id, .. } => *id,
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum AgentReply {
    Done,
    Started { addr: SocketAddr },
    Address { addr: Option<SocketAddr> },
    /// The pool's own error, as the local pool would have returned it.
    Failed { error: PoolError },
    /// The request itself was bad (unreadable, an unsafe application name): nothing was done.
    Refused { why: String },
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("frame of {0} bytes is over the limit of {MAX_AGENT_FRAME_BYTES} bytes")]
    TooLarge(usize),
    #[error("unreadable frame: {0}")]
    Malformed(String),
}

/// The frame carrying `msg`.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(msg).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.len() > MAX_AGENT_FRAME_BYTES {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut f = Vec::with_capacity(FRAME_HEADER_BYTES + body.len());
    f.extend_from_slice(&(body.len() as u32).to_be_bytes());
    f.extend_from_slice(&body);
    Ok(f)
}

/// The body length a frame header announces, refused over the limit (before any of it is read).
pub fn body_len(header: [u8; FRAME_HEADER_BYTES]) -> Result<usize, FrameError> {
    let n = u32::from_be_bytes(header) as usize;
    if n > MAX_AGENT_FRAME_BYTES {
        return Err(FrameError::TooLarge(n));
    }
    Ok(n)
}

pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// An application name is a directory under the agent's state directory: letters, digits,
/// `.`, `_`, `-`, not starting with `.`, at most [`MAX_APP_NAME_BYTES`].
pub fn check_app_name(app: &str) -> Result<(), String> {
    let ok = !app.is_empty()
        && app.len() <= MAX_APP_NAME_BYTES
        && !app.starts_with('.')
        && app.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!("application name {app:?} must be 1-{MAX_APP_NAME_BYTES} of [A-Za-z0-9._-], not starting with '.'"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused_by_their_header() {
        let req = AgentRequest::Kill { app: "db".into(), id: InstanceId(3) };
        let f = encode(&req).unwrap();
        let n = body_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, f.len() - 4);
        assert_eq!(decode::<AgentRequest>(&f[4..]).unwrap(), req);
        let reply = AgentReply::Failed { error: PoolError::Killed(InstanceId(3)) };
        assert_eq!(decode::<AgentReply>(&encode(&reply).unwrap()[4..]).unwrap(), reply);

        assert_eq!(body_len(((MAX_AGENT_FRAME_BYTES + 1) as u32).to_be_bytes()), Err(FrameError::TooLarge(MAX_AGENT_FRAME_BYTES + 1)));
        assert_eq!(body_len(u32::MAX.to_be_bytes()), Err(FrameError::TooLarge(u32::MAX as usize)));
        let huge = AgentRequest::Start {
            app: "db".into(),
            id: InstanceId(1),
            volume: "v".into(),
            spec: AppSpec { command: vec!["x".repeat(MAX_AGENT_FRAME_BYTES)], env: Default::default(), stop_grace_ms: 1 },
            mkfs_first: false,
        };
        assert!(matches!(encode(&huge), Err(FrameError::TooLarge(_))));
        assert!(matches!(decode::<AgentRequest>(b"{\"op\":\"format_disk\"}"), Err(FrameError::Malformed(_))));
    }

    #[test]
    fn unsafe_application_names_are_refused() {
        for bad in ["", ".", "..", "../etc", "a/b", ".hidden", "a b", &"x".repeat(MAX_APP_NAME_BYTES + 1)] {
            assert!(check_app_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["db", "pg-1", "app_2.v3"] {
            check_app_name(good).unwrap();
        }
    }
}
