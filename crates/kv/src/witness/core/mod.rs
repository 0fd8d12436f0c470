//! The sans-I/O parts of the witness KV: time and randomness are inputs, nothing here does I/O.

pub mod detector;
pub mod popularity;
