//! Tokio drivers (node server, CM server, async client).
