//! Catch-up streaming, the Buddy's side (HEAL §V-C): a recovering node's CatchUp_req opens a
//! stream, its credits let the Buddy send one bounded chunk each, built from Missed_updates and
//! the Partially_persisted keys (or, for the baselines, see [`super::baselines`]).

use super::*;

impl NodeCore {
    pub(super) fn on_catchup_req(
        &mut self,
        from: NodeId,
        stream: u64,
        partially: Vec<(Vec<u8>, Ts)>,
        cursor: Cursor,
        chunks: u32,
    ) {
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            return;
        }
        if partially.len() > self.p.max_pending_client_ops.max(1 << 16) {
            return; // not a list a crash can leave behind: refuse rather than work on it
        }
        self.counters.catchup_served += 1;
        // Never more than the largest window a node may be configured with.
        let credits = chunks.clamp(1, MAX_CATCHUP_CHUNKS_PER_REQ);
        // A new request replaces any stream of the node (it gave up on it).
        self.streams.remove(&from);
        self.log_reads.remove(&from);
        match cursor {
            Cursor::Key(after) => {
                let full_copy = self.missed.overflowed
                    || !self.missed.recording
                    || self.p.recovery != RecoveryScheme::Heal;
                // The first chunk now, the rest one per `pump`: the recovering node applies and
                // persists each while the next is read here, and our own clients are served
                // between chunks.
                self.streams.insert(
                    from,
                    KeyStream {
                        stream,
                        after,
                        partially,
                        full_copy,
                        credits,
                        sent: 0,
                    },
                );
                self.stream_chunk(from);
            }
            Cursor::Log(lc) => {
                // Reactive: the durable log is read from the point (by the driver, off the
                // protocol path), then answered in `on_log_read`, which reads on while the
                // stream has credit. One read at a time per recovering node.
                let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, 0);
                self.log_reads.insert(
                    from,
                    LogStream {
                        stream,
                        cursor: lc.clone(),
                        partially,
                        credits,
                        reading: true,
                        sent: 0,
                    },
                );
                self.out.push(Output::ReadLog {
                    to: from,
                    cursor: lc,
                    max_bytes,
                });
            }
        }
    }

    /// More credit for the stream `stream` of node `from`, if it is the one being served.
    pub(super) fn on_catchup_credit(&mut self, from: NodeId, stream: u64, chunks: u32) {
        if let Some(st) = self.streams.get_mut(&from).filter(|st| st.stream == stream) {
            st.credits = st
                .credits
                .saturating_add(chunks)
                .min(MAX_CATCHUP_CHUNKS_PER_REQ);
            return;
        }
        let max_bytes = self.p.max_catchup_chunk_bytes;
        if let Some(ls) = self
            .log_reads
            .get_mut(&from)
            .filter(|ls| ls.stream == stream)
        {
            let max_bytes = catchup_chunk_bytes(max_bytes, ls.sent);
            ls.credits = ls
                .credits
                .saturating_add(chunks)
                .min(MAX_CATCHUP_CHUNKS_PER_REQ);
            if !ls.reading && ls.credits > 0 {
                ls.reading = true;
                let cursor = ls.cursor.clone();
                self.out.push(Output::ReadLog {
                    to: from,
                    cursor,
                    max_bytes,
                });
            }
        }
    }

    /// Whether a key-ordered catch-up stream is open here (possibly waiting for credit).
    pub fn serves_catchup(&self) -> bool {
        !self.streams.is_empty()
    }

    /// Whether [`NodeInput::Pump`] has work (catch-up chunks credited and not sent yet).
    pub fn wants_pump(&self) -> bool {
        self.streams.values().any(|st| st.credits > 0)
    }

    pub(super) fn pump_input(&mut self, _now_us: u64) {
        let to: Vec<NodeId> = self
            .streams
            .iter()
            .filter(|(_, st)| st.credits > 0)
            .map(|(n, _)| *n)
            .collect();
        for n in to {
            self.stream_chunk(n);
        }
    }

    pub(super) fn stream_chunk(&mut self, to: NodeId) {
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            self.streams.clear();
            return;
        }
        let Some(st) = self.streams.get(&to) else {
            return;
        };
        if st.credits == 0 {
            return;
        }
        let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, st.sent);
        let (entries, next) =
            self.key_chunk(st.after.as_deref(), &st.partially, st.full_copy, max_bytes);
        let st = self.streams.get_mut(&to).unwrap();
        st.credits -= 1;
        st.sent += 1;
        let (stream, full_copy) = (st.stream, st.full_copy);
        let from = Cursor::Key(match &next {
            Some(Cursor::Key(k)) => std::mem::replace(&mut st.after, k.clone()),
            _ => self.streams.remove(&to).unwrap().after, // the last chunk: the stream ends
        });
        let epoch = self.config.epoch;
        self.send(
            to,
            PeerMsg::CatchUpResp {
                epoch,
                stream,
                from,
                next,
                full_copy,
                entries,
            },
        );
    }

    /// The next chunk after `after` of a key-ordered copy: every key of the store (a full
    /// copy), or HEAL's Missed_updates plus the Partially_persisted keys. The current version
    /// of each key is the newest update to it; a Partially_persisted entry is judged by
    /// sending ours: the recovering node keeps its own only if ours equals it. Built straight
    /// into the chunk's bytes: a copy per entry (HEAL's from the buffer, with a store lookup
    /// only for keys with a write in flight), one allocation per chunk.
    pub(super) fn key_chunk(
        &self,
        after: Option<&[u8]>,
        partially: &[(Vec<u8>, Ts)],
        full: bool,
        max_bytes: usize,
    ) -> (Chunk, Option<Cursor>) {
        use std::ops::Bound;
        let lower = match after {
            Some(k) => Bound::Excluded(k),
            None => Bound::Unbounded,
        };
        let mut chunk = Chunk::with_capacity(
            max_bytes.min(MAX_CHUNK_PREALLOC_BYTES) + CHUNK_ENTRY_HEADER_BYTES + MAX_KEY_BYTES,
        );
        let mut add = |key: &[u8], ts: Ts, value: &[u8], valid: bool| -> bool {
            if ts != Ts::default() {
                chunk.push(key, ts, value, valid);
            }
            chunk.len_bytes() >= max_bytes
        };
        let last = if full {
            self.full_copy_chunk(lower, &mut add)
        } else {
            let mut extra: Vec<&[u8]> = partially
                .iter()
                .map(|(k, _)| k.as_slice())
                .filter(|k| after.is_none_or(|a| *k > a))
                .collect();
            extra.sort_unstable();
            extra.dedup();
            let missed = self
                .missed
                .keys
                .range::<[u8], _>((lower, Bound::Unbounded))
                .map(|(k, m)| (k.as_slice(), m));
            let mut last = None;
            for (key, m) in (MergeKeys {
                a: missed.peekable(),
                b: extra.into_iter().peekable(),
            }) {
                // A buffered key with nothing unsettled is valid (an invalid key is always
                // unsettled) at the buffer's version: no store lookup. A write in flight, or a
                // Partially_persisted key the buffer lacks, is read from the store.
                let (ts, value, valid) = match m {
                    Some(m) if !self.unsettled.contains(key) => {
                        debug_assert_eq!(
                            self.store.get(key).map(|k| (k.ts, &k.value[..], k.valid)),
                            Some((m.ts, &m.value[..], true)),
                            "Missed_updates out of step with the store"
                        );
                        (m.ts, &m.value[..], true)
                    }
                    _ => match self.store.get(key) {
                        Some(k) => (k.ts, &k.value[..], k.valid),
                        None => continue,
                    },
                };
                if add(key, ts, value, valid) {
                    last = Some(key.to_vec());
                    break;
                }
            }
            last
        };
        (chunk, last.map(|k| Cursor::Key(Some(k))))
    }
}

/// Merges the Missed_updates buffer's keys (ascending, with their updates) with other
/// ascending keys, each key once (with its update if the buffer has it).
pub(super) struct MergeKeys<'a, A, B>
where
    A: Iterator<Item = (&'a [u8], &'a MissedUpdate)>,
    B: Iterator<Item = &'a [u8]>,
{
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<'a, A, B> Iterator for MergeKeys<'a, A, B>
where
    A: Iterator<Item = (&'a [u8], &'a MissedUpdate)>,
    B: Iterator<Item = &'a [u8]>,
{
    type Item = (&'a [u8], Option<&'a MissedUpdate>);
    fn next(&mut self) -> Option<Self::Item> {
        let a = |x: Option<(&'a [u8], &'a MissedUpdate)>| x.map(|(k, m)| (k, Some(m)));
        match (self.a.peek(), self.b.peek()) {
            (Some((x, _)), Some(y)) => {
                if x < y {
                    a(self.a.next())
                } else if y < x {
                    self.b.next().map(|k| (k, None))
                } else {
                    self.b.next();
                    a(self.a.next())
                }
            }
            (Some(_), None) => a(self.a.next()),
            (None, _) => self.b.next().map(|k| (k, None)),
        }
    }
}
