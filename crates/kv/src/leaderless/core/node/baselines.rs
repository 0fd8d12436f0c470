//! The two baselines of HEAL §IX, run by the same core and harness: the reactive log of §II-C
//! (ZooKeeper: the Buddy reads its durable log from the recovering node's last configuration,
//! redundant updates included) and the full copy of the store (Hermes; its chunks are built by
//! [`NodeCore::key_chunk`] over the whole store).

use super::*;

impl NodeCore {
    /// The reactive baseline's Buddy read its log for `to`: the read becomes the next
    /// CatchUp_resp (or, when the log does not reach back far enough, a snapshot stream). One
    /// pass kept whole (about 120 lines): the steps share the chunk being built, the stream's
    /// cursor and the first chunk's Partially_persisted judgement.
    pub(super) fn on_log_read_input(
        &mut self,
        _now_us: u64,
        to: NodeId,
        cursor: LogCursor,
        chunk: LogChunk,
    ) {
        match self.log_reads.get(&to) {
            Some(ls) if ls.reading && ls.cursor == cursor => {}
            _ => return,
        }
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            self.log_reads.remove(&to);
            return;
        }
        let ls = self.log_reads.get_mut(&to).unwrap();
        ls.reading = false;
        ls.credits = ls.credits.saturating_sub(1);
        ls.sent += 1;
        let (stream, credits, sent) = (ls.stream, ls.credits, ls.sent);
        let partially = std::mem::take(&mut ls.partially);
        let epoch = self.config.epoch;
        let from = Cursor::Log(cursor.clone());
        if !chunk.found {
            // Our log does not reach back to where the node left: send a snapshot instead, on
            // as a key stream with the credit left.
            self.log_reads.remove(&to);
            let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, sent - 1);
            let (entries, next) = self.key_chunk(None, &[], true, max_bytes);
            if let Some(Cursor::Key(after)) = &next {
                self.streams.insert(
                    to,
                    KeyStream {
                        stream,
                        after: after.clone(),
                        partially: Vec::new(),
                        full_copy: true,
                        credits,
                        sent,
                    },
                );
            }
            self.send(
                to,
                PeerMsg::CatchUpResp {
                    epoch,
                    stream,
                    from,
                    next,
                    full_copy: true,
                    entries,
                },
            );
            return;
        }
        let LogChunk {
            mut entries,
            unmarked,
            gen,
            next_pos,
            at_end,
            ..
        } = chunk;
        for at in unmarked {
            // The log's flag was past this read (or lost): committed if the store holds a
            // newer version, or this one valid.
            let at = at as usize;
            let (e, _) = entries.entry_at(at).expect("offsets the log read gave");
            let committed = self
                .store
                .get(e.key)
                .is_some_and(|k| e.ts < k.ts || (e.ts == k.ts && k.valid));
            if committed {
                entries.set_committed(at);
            }
        }
        if cursor.pos.is_none() {
            // The first chunk also judges the Partially_persisted entries (like ZooKeeper's
            // TRUNC of a learner's uncommitted tail).
            for (key, _) in partially {
                if let Some(k) = self.store.get(&key[..]).filter(|k| k.ts != Ts::default()) {
                    entries.push(&key, k.ts, &k.value, k.valid);
                }
            }
        }
        let next_lc = LogCursor {
            since_epoch: cursor.since_epoch,
            gen,
            pos: Some(next_pos),
        };
        let next = (!at_end).then_some(Cursor::Log(next_lc.clone()));
        self.send(
            to,
            PeerMsg::CatchUpResp {
                epoch,
                stream,
                from,
                next,
                full_copy: false,
                entries,
            },
        );
        if at_end {
            self.log_reads.remove(&to);
            return;
        }
        let ls = self.log_reads.get_mut(&to).unwrap();
        ls.cursor = next_lc.clone();
        if credits > 0 {
            // Read on from where this chunk ended.
            ls.reading = true;
            let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, sent);
            self.out.push(Output::ReadLog {
                to,
                cursor: next_lc,
                max_bytes,
            });
        }
    }

    /// The full-copy baseline's chunk (Hermes): the store in key order from `lower`, no lookup
    /// per entry, each version given to `add` until it says the chunk is full. Returns the last
    /// key taken when the chunk filled (the stream goes on after it), `None` at the store's end.
    pub(super) fn full_copy_chunk(
        &self,
        lower: std::ops::Bound<&[u8]>,
        add: &mut impl FnMut(&[u8], Ts, &[u8], bool) -> bool,
    ) -> Option<Vec<u8>> {
        for (key, k) in self
            .store
            .range::<[u8], _>((lower, std::ops::Bound::Unbounded))
        {
            if add(key, k.ts, &k.value, k.valid) {
                return Some(key.to_vec());
            }
        }
        None
    }
}
