//! Redis adapter (next step).
