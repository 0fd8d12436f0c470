use super::*;

fn cfg(epoch: u64, active: &[NodeId], recovering: &[NodeId]) -> Config {
    Config {
        epoch,
        nodes: vec![0, 1, 2],
        active: active.iter().copied().collect(),
        recovering: recovering.iter().copied().collect(),
    }
}

fn persist_all(n: &mut NodeCore, now: u64) {
    loop {
        let seqs: Vec<u64> = n
            .take_outputs()
            .into_iter()
            .filter_map(|o| match o {
                Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => Some(seq),
                _ => None,
            })
            .collect();
        if seqs.is_empty() {
            return;
        }
        for s in seqs {
            n.handle(now, NodeInput::Persisted(vec![s]));
        }
    }
}

/// Issue 22 §2 (found by the simulator's node pauses): a node stopped past its lease read,
/// when continued, the heartbeats that had waited in its socket and took a lease from now,
/// while the CM had already removed it and the others had written without it: it served
/// stale reads until the heartbeat of the new configuration came through. The lease counts
/// from when the node sent the ack the heartbeat echoes.
#[test]
fn a_heartbeat_read_late_gives_no_lease_past_its_echo() {
    let lease = NodeParams::new(0, Model::Synch).lease_us;
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
    let config = cfg(1, &[0, 1, 2], &[]);
    let hb = |seq, lease_ref| Heartbeat {
        seq,
        config: config.clone(),
        lease_ref,
    };
    n.handle(0, NodeInput::Heartbeat(hb(0, 0)));
    persist_all(&mut n, 0);
    assert!(!n.serving(1), "no ack echoed yet: no lease");
    let first = n.last_lease_ref();
    n.handle(1_000, NodeInput::Heartbeat(hb(1, first)));
    assert!(
        n.serving(2_000) && !n.serving(lease),
        "lease from the ack at 0"
    );
    // Stopped from 2 ms to 10 leases; the heartbeat sent at 3 ms is read on waking.
    let second = n.last_lease_ref();
    let woke = 10 * lease;
    n.handle(woke, NodeInput::Heartbeat(hb(2, second)));
    assert!(!n.serving(woke), "a heartbeat read late extends nothing");
    // A fresh heartbeat, echoing the ack sent on waking, gives the lease back.
    let third = n.last_lease_ref();
    n.handle(woke + 1_000, NodeInput::Heartbeat(hb(3, third)));
    assert!(n.serving(woke + 2_000));
    // An echo of an ack this core never sent (an earlier core's) anchors nothing.
    let mut m = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
    m.handle(0, NodeInput::Heartbeat(hb(0, 0)));
    persist_all(&mut m, 0);
    m.handle(1_000, NodeInput::Heartbeat(hb(1, first + 1_000)));
    assert!(!m.serving(2_000));
}

/// Regression for the model-check finding (MODEL_EAGER_TIMEOUTS=1, Strict and Eventual):
/// a write made globally durable in epoch 2 (members 1, 2) gets a late ACK with only
/// ACK_C from node 0, which came back as a recovering node in epoch 3 and has not
/// persisted the version. The repeated VAL must not carry VAL_P (Table IV, 3b); the
/// node's ACK_P, once it persisted, gets it.
#[test]
fn late_ack_c_from_recovering_node_gets_no_val_p() {
    for model in [Model::Strict, Model::Eventual, Model::ReadEnforced] {
        let mut n = NodeCore::new(NodeParams::new(1, model), LogState::default());
        n.handle(
            0,
            NodeInput::Heartbeat(Heartbeat {
                seq: 0,
                config: cfg(1, &[0, 1, 2], &[]),
                lease_ref: n.last_lease_ref(),
            }),
        );
        persist_all(&mut n, 0);
        n.handle(
            1,
            NodeInput::Heartbeat(Heartbeat {
                seq: 1,
                config: cfg(2, &[1, 2], &[]),
                lease_ref: n.last_lease_ref(),
            }),
        );
        n.take_outputs();
        let key = b"b".to_vec();
        n.handle(
            2,
            NodeInput::Client {
                tag: 7,
                op: ClientOp::Put {
                    key: key.clone(),
                    value: b"v".to_vec(),
                    scope: None,
                },
            },
        );
        persist_all(&mut n, 2);
        let ts = Ts {
            version: 1,
            node: 1,
        };
        n.handle(
            3,
            NodeInput::Peer {
                from: 2,
                msg: PeerMsg::Ack {
                    epoch: 2,
                    key: key.clone(),
                    ts,
                    c: true,
                    p: true,
                },
            },
        );
        let outs = n.take_outputs();
        assert!(
            outs.contains(&Output::Reply {
                tag: 7,
                result: ClientResult::Done
            }),
            "{model}: write done in epoch 2: {outs:?}"
        );
        n.handle(
            4,
            NodeInput::Heartbeat(Heartbeat {
                seq: 2,
                config: cfg(3, &[1, 2], &[0]),
                lease_ref: n.last_lease_ref(),
            }),
        );
        n.take_outputs();
        let val_to_0 = |outs: Vec<Output>| -> Vec<(bool, bool)> {
            outs.into_iter()
                .filter_map(|o| match o {
                    Output::Send {
                        to: 0,
                        msg: PeerMsg::Val { c, p, .. },
                    } => Some((c, p)),
                    _ => None,
                })
                .collect()
        };
        n.handle(
            5,
            NodeInput::Peer {
                from: 0,
                msg: PeerMsg::Ack {
                    epoch: 3,
                    key: key.clone(),
                    ts,
                    c: true,
                    p: false,
                },
            },
        );
        assert_eq!(val_to_0(n.take_outputs()), vec![(true, false)], "{model}");
        n.handle(
            6,
            NodeInput::Peer {
                from: 0,
                msg: PeerMsg::Ack {
                    epoch: 3,
                    key: key.clone(),
                    ts,
                    c: false,
                    p: true,
                },
            },
        );
        assert_eq!(val_to_0(n.take_outputs()), vec![(true, true)], "{model}");
    }
}

fn entry(key: &str, version: u64) -> Entry {
    Entry {
        key: key.as_bytes().to_vec(),
        ts: Ts { version, node: 2 },
        value: b"v".to_vec(),
        committed: true,
    }
}

fn key_cursor(after: Option<&str>) -> Cursor {
    Cursor::Key(after.map(|a| a.as_bytes().to_vec()))
}

/// Node 0 returns in epoch 2 (members 1, 2) and gets both Recov_start ACKs: its Buddy is 1.
fn recovering_node(window: usize) -> (NodeCore, Vec<Output>) {
    recovering_node_with(window, RecoveryScheme::Heal, LogState::default())
}

fn recovering_node_with(
    window: usize,
    scheme: RecoveryScheme,
    st: LogState,
) -> (NodeCore, Vec<Output>) {
    let mut p = NodeParams::new(0, Model::Strict);
    p.max_catchup_chunks_in_flight = window;
    p.recovery = scheme;
    let mut n = NodeCore::new(p, st);
    n.handle(
        0,
        NodeInput::Heartbeat(Heartbeat {
            seq: 0,
            config: cfg(2, &[1, 2], &[0]),
            lease_ref: n.last_lease_ref(),
        }),
    );
    let mut outs = n.take_outputs();
    n.handle(
        1,
        NodeInput::Peer {
            from: 1,
            msg: PeerMsg::RecovStartAck { epoch: 2 },
        },
    );
    n.handle(
        1,
        NodeInput::Peer {
            from: 2,
            msg: PeerMsg::RecovStartAck { epoch: 2 },
        },
    );
    outs.extend(n.take_outputs());
    (n, outs)
}

/// (to, stream, cursor, chunks) of every CatchUp_req.
fn catchup_reqs(outs: &[Output]) -> Vec<(NodeId, u64, Cursor, u32)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Send {
                to,
                msg:
                    PeerMsg::CatchUpReq {
                        stream,
                        cursor,
                        chunks,
                        ..
                    },
            } => Some((*to, *stream, cursor.clone(), *chunks)),
            _ => None,
        })
        .collect()
}

/// (stream, chunks) of every CatchUp_credit.
fn credits(outs: &[Output]) -> Vec<(u64, u32)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Send {
                msg: PeerMsg::CatchUpCredit { stream, chunks, .. },
                ..
            } => Some((*stream, *chunks)),
            _ => None,
        })
        .collect()
}

fn persists(outs: &[Output]) -> Vec<u64> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Persist {
                seq,
                rec: LogRecord::Put { .. },
            }
            | Output::PersistChunk { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

fn sent_recov_end(outs: &[Output]) -> bool {
    outs.iter().any(|o| {
        matches!(
            o,
            Output::Send {
                msg: PeerMsg::RecovEnd { .. },
                ..
            }
        )
    })
}

fn resp(stream: u64, from: Option<&str>, next: Option<&str>, entries: Vec<Entry>) -> PeerMsg {
    PeerMsg::CatchUpResp {
        epoch: 2,
        stream,
        from: key_cursor(from),
        next: next.map(|n| key_cursor(Some(n))),
        full_copy: false,
        entries: Chunk::from_entries(&entries),
    }
}

/// The chunk format: what is pushed comes back, in order, with its offsets; truncated,
/// oversized or flagged-wrong bytes are refused, never a panic.
#[test]
fn chunk_round_trips_and_refuses_malformed_bytes() {
    let es = vec![
        entry("a", 1),
        Entry {
            key: vec![7; MAX_KEY_BYTES],
            ts: Ts {
                version: u64::MAX,
                node: 9,
            },
            value: vec![1; 3000],
            committed: false,
        },
        entry("c", 3),
    ];
    let c = Chunk::from_entries(&es);
    assert_eq!(c.validate(), Ok(3));
    assert_eq!(c.to_entries().unwrap(), es);
    let offs: Vec<usize> = c.iter().map(|r| r.unwrap().0).collect();
    assert_eq!(offs[0], 0);
    assert_eq!(c.entry_at(offs[2]).unwrap().0.to_entry(), es[2]);
    let bytes = postcard::to_allocvec(&c).unwrap();
    assert_eq!(postcard::from_bytes::<Chunk>(&bytes).unwrap(), c);
    let raw = |b: Vec<u8>| -> Chunk {
        postcard::from_bytes(&postcard::to_allocvec(&serde_bytes::ByteBuf::from(b)).unwrap())
            .unwrap()
    };
    let good: Vec<u8> = postcard::from_bytes::<serde_bytes::ByteBuf>(&bytes)
        .unwrap()
        .into_vec();
    for cut in 1..good.len() {
        let r = raw(good[..cut].to_vec()).validate();
        assert!(r.is_err() || offs.contains(&cut), "cut at {cut}: {r:?}");
    }
    let mut flags = good.clone();
    flags[2 + 1 + 12] = 2; // the first entry's flags
    assert!(raw(flags).validate().is_err());
    let mut empty_key = good.clone();
    empty_key[0] = 0;
    assert!(raw(empty_key).validate().is_err());
    let mut huge: Vec<u8> = Vec::new();
    huge.extend_from_slice(&1u16.to_le_bytes());
    huge.push(b'k');
    huge.extend_from_slice(&[0; 13]);
    huge.extend_from_slice(&(MAX_VALUE_BYTES as u32 + 1).to_le_bytes());
    assert!(raw(huge).validate().is_err());
}

/// A window of 3: the stream opens with 3 credits; chunks arrive back to back; a chunk
/// made durable frees a slot and, the Buddy holding no credit, a credit of 1 goes at once
/// (no new request: no round trip); late, duplicated, reordered and other streams' replies
/// are ignored (they never roll a key back); Recov_end waits for every chunk to be durable.
#[test]
fn catchup_pipelines_within_window_and_ends_only_when_durable() {
    let (mut n, outs) = recovering_node(3);
    let boot: Vec<u64> = outs
        .iter()
        .filter_map(|o| match o {
            Output::Persist {
                seq,
                rec: LogRecord::Boot { .. },
            } => Some(*seq),
            _ => None,
        })
        .collect();
    let reqs = catchup_reqs(&outs);
    assert_eq!(reqs.len(), 1);
    let (to, st, cursor, chunks) = reqs[0].clone();
    assert_eq!(
        (to, cursor, chunks),
        (1, key_cursor(None), 3),
        "the whole window in one request"
    );
    let mut unpersisted = Vec::new();
    for (i, (from, next, e)) in [
        (None, "a", entry("a", 5)),
        (Some("a"), "b", entry("b", 5)),
        (Some("b"), "c", entry("c", 5)),
    ]
    .into_iter()
    .enumerate()
    {
        n.handle(
            10 + i as u64,
            NodeInput::Peer {
                from: 1,
                msg: resp(st, from, Some(next), vec![e]),
            },
        );
        let outs = n.take_outputs();
        let p = persists(&outs);
        assert_eq!(p.len(), 1, "chunk {i} applied and persisted: {outs:?}");
        unpersisted.extend(p);
        assert!(
            catchup_reqs(&outs).is_empty() && credits(&outs).is_empty(),
            "chunk {i}: window full"
        );
    }
    // A late duplicate of chunk 1 carrying an older version of "a", a reply for a cursor
    // not asked for, a chunk of another stream and a fourth chunk past the credit change
    // nothing.
    n.handle(
        20,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, None, Some("a"), vec![entry("a", 3)]),
        },
    );
    n.handle(
        20,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, Some("c"), Some("d"), vec![entry("d", 1)]).clone(),
        },
    );
    n.handle(
        20,
        NodeInput::Peer {
            from: 1,
            msg: resp(st + 7, Some("c"), Some("d"), vec![entry("d", 1)]),
        },
    );
    assert!(n.take_outputs().is_empty());
    assert!(!n.store.contains_key(b"d".as_slice()));
    // Chunk 2 becomes durable first: a slot frees and a credit of 1 goes at once.
    n.handle(21, NodeInput::Persisted(vec![unpersisted[1]]));
    let outs = n.take_outputs();
    assert!(
        catchup_reqs(&outs).is_empty(),
        "the stream stays open: {outs:?}"
    );
    assert_eq!(credits(&outs), vec![(st, 1)]);
    // Last chunk: applied; Recov_end waits for all chunks and the Boot record.
    n.handle(
        22,
        NodeInput::Peer {
            from: 1,
            msg: PeerMsg::CatchUpResp {
                epoch: 2,
                stream: st,
                from: key_cursor(Some("c")),
                next: None,
                full_copy: false,
                entries: Chunk::from_entries(&[entry("c", 9), entry("a", 2)]),
            },
        },
    );
    let outs = n.take_outputs();
    assert_eq!(
        persists(&outs).len(),
        1,
        "older version of a is not applied: {outs:?}"
    );
    unpersisted.extend(persists(&outs));
    assert!(!sent_recov_end(&outs));
    for s in boot
        .iter()
        .chain(&unpersisted)
        .filter(|s| **s != unpersisted[1])
    {
        assert!(
            !sent_recov_end(&n.take_outputs()),
            "Recov_end before every chunk is durable"
        );
        n.handle(23, NodeInput::Persisted(vec![*s]));
    }
    let outs = n.take_outputs();
    assert!(sent_recov_end(&outs), "{boot:?} {unpersisted:?} {outs:?}");
    assert!(n.is_recovering() || matches!(n.mode, Mode::Recovered));
    let a = n.store.get(b"a".as_slice()).unwrap();
    assert_eq!(
        a.ts,
        Ts {
            version: 5,
            node: 2
        },
        "a is never rolled back"
    );
}

/// HEAL logs only the entries it applies; the baselines log every entry they receive,
/// redundant ones included (the stale one is still not applied).
#[test]
fn baselines_log_redundant_entries_heal_does_not() {
    for (scheme, logged) in [
        (RecoveryScheme::Heal, 1),
        (RecoveryScheme::FullCopy, 2),
        (RecoveryScheme::ReactiveLog, 2),
    ] {
        let mut st = LogState::default();
        st.base.insert(
            b"a".to_vec(),
            (
                Ts {
                    version: 5,
                    node: 2,
                },
                b"new".to_vec(),
            ),
        );
        let (mut n, outs) = recovering_node_with(1, scheme, st);
        // A key stream for HEAL and the full copy, a log stream for the reactive log: the
        // same entries answer either, the older "a" redundant.
        let (_, stream, cursor, _) = catchup_reqs(&outs)[0].clone();
        n.handle(
            10,
            NodeInput::Peer {
                from: 1,
                msg: PeerMsg::CatchUpResp {
                    epoch: 2,
                    stream,
                    from: cursor,
                    next: None,
                    full_copy: false,
                    entries: Chunk::from_entries(&[entry("a", 3), entry("b", 4)]),
                },
            },
        );
        let outs = n.take_outputs();
        let puts: usize = outs
            .iter()
            .filter_map(|o| match o {
                Output::PersistChunk { puts, .. } => Some(
                    puts.records()
                        .iter()
                        .filter(|r| matches!(r, LogRecord::Put { .. }))
                        .count(),
                ),
                _ => None,
            })
            .sum();
        assert_eq!(puts, logged, "{scheme:?}: {outs:?}");
        assert_eq!(
            n.store.get(b"a".as_slice()).unwrap().ts.version,
            5,
            "{scheme:?}: the stale entry is not applied"
        );
        assert_eq!(n.store.get(b"b".as_slice()).unwrap().ts.version, 4);
    }
}

fn full_copy_buddy(keys: usize, chunk_bytes: usize) -> NodeCore {
    let mut p = NodeParams::new(1, Model::Strict);
    p.max_catchup_chunk_bytes = chunk_bytes;
    p.recovery = RecoveryScheme::FullCopy; // every key is sent
    let mut st = LogState::default();
    for i in 0..keys {
        st.base.insert(
            format!("k{i:04}").into_bytes(),
            (
                Ts {
                    version: 1,
                    node: 1,
                },
                vec![i as u8; 10],
            ),
        );
    }
    let mut n = NodeCore::new(p, st);
    n.handle(
        0,
        NodeInput::Heartbeat(Heartbeat {
            seq: 0,
            config: cfg(2, &[1, 2], &[0]),
            lease_ref: n.last_lease_ref(),
        }),
    );
    n.take_outputs();
    n
}

/// A Buddy sends one chunk per credit, back to back, each naming where the next starts;
/// with no credit left the stream waits (open) for CatchUp_credit; credit for another
/// stream is ignored; a new request replaces the stream; it ends at the end.
#[test]
fn buddy_streams_one_chunk_per_credit() {
    let mut n = full_copy_buddy(5, 1); // one entry per chunk: k0000..k0004
    let resps = |outs: Vec<Output>| -> Vec<(u64, Cursor, Option<Cursor>, usize)> {
        outs.into_iter()
            .filter_map(|o| match o {
                Output::Send {
                    to: 0,
                    msg:
                        PeerMsg::CatchUpResp {
                            stream,
                            from,
                            next,
                            entries,
                            ..
                        },
                } => Some((stream, from, next, entries.validate().unwrap())),
                _ => None,
            })
            .collect()
    };
    let pumped = |n: &mut NodeCore| {
        let mut outs = n.take_outputs();
        while n.wants_pump() {
            n.handle(1, NodeInput::Pump);
            outs.extend(n.take_outputs());
        }
        outs
    };
    let k = |i: usize| key_cursor(Some(&format!("k{i:04}")));
    n.handle(
        1,
        NodeInput::Peer {
            from: 0,
            msg: PeerMsg::CatchUpReq {
                epoch: 2,
                stream: 4,
                partially: vec![],
                cursor: key_cursor(None),
                chunks: 2,
            },
        },
    );
    assert_eq!(resps(n.take_outputs()).len(), 1, "the first chunk at once");
    assert!(n.wants_pump());
    assert_eq!(resps(pumped(&mut n)), vec![(4, k(0), Some(k(1)), 1)]);
    assert!(!n.wants_pump(), "no credit left");
    n.handle(
        2,
        NodeInput::Peer {
            from: 0,
            msg: PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 3,
                chunks: 5,
            },
        },
    );
    assert!(!n.wants_pump(), "credit of another stream");
    n.handle(
        2,
        NodeInput::Peer {
            from: 0,
            msg: PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 4,
                chunks: 2,
            },
        },
    );
    assert_eq!(
        resps(pumped(&mut n)),
        vec![(4, k(1), Some(k(2)), 1), (4, k(2), Some(k(3)), 1)]
    );
    // A retry from k(1) replaces the stream.
    n.handle(
        3,
        NodeInput::Peer {
            from: 0,
            msg: PeerMsg::CatchUpReq {
                epoch: 2,
                stream: 5,
                partially: vec![],
                cursor: k(1),
                chunks: 9,
            },
        },
    );
    let got = resps(pumped(&mut n));
    // k0002, k0003, k0004, then an empty last chunk (a full chunk always names a next).
    assert_eq!(got.len(), 4, "stops at the end: {got:?}");
    assert!(got.iter().all(|g| g.0 == 5));
    assert_eq!(got[3].2, None);
    assert!(n.streams.is_empty(), "the ended stream is dropped");
    n.handle(
        4,
        NodeInput::Peer {
            from: 0,
            msg: PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 5,
                chunks: 2,
            },
        },
    );
    assert!(!n.wants_pump() && n.take_outputs().is_empty());
}

/// A stream's chunks ramp up from [`FIRST_CATCHUP_CHUNK_BYTES`], doubling, to the
/// configured size, and restart small when a retry replaces the stream.
#[test]
fn catchup_chunks_ramp_up_to_the_configured_size() {
    let max = 2 * FIRST_CATCHUP_CHUNK_BYTES;
    let entry_bytes = CHUNK_ENTRY_HEADER_BYTES + 5 + 10; // "k0000" and a 10-byte value
    let mut n = full_copy_buddy(9999, max);
    let sizes = |n: &mut NodeCore| -> Vec<usize> {
        let mut outs = n.take_outputs();
        while n.wants_pump() {
            n.handle(1, NodeInput::Pump);
            outs.extend(n.take_outputs());
        }
        outs.into_iter()
            .filter_map(|o| match o {
                Output::Send {
                    msg: PeerMsg::CatchUpResp { entries, .. },
                    ..
                } => Some(entries.len_bytes()),
                _ => None,
            })
            .collect()
    };
    let req = |stream| PeerMsg::CatchUpReq {
        epoch: 2,
        stream,
        partially: vec![],
        cursor: key_cursor(None),
        chunks: 5,
    };
    n.handle(
        1,
        NodeInput::Peer {
            from: 0,
            msg: req(1),
        },
    );
    let got = sizes(&mut n);
    // 9999 entries, 340 KB: 64 KiB, then 128 KiB chunks. A chunk closes with the entry
    // that reaches its limit.
    assert_eq!(got.len(), 4, "{got:?}");
    for (i, limit) in [1, 2, 2].into_iter().enumerate() {
        let limit = limit * FIRST_CATCHUP_CHUNK_BYTES;
        assert!(
            got[i] >= limit && got[i] < limit + entry_bytes,
            "chunk {i}: {} bytes, limit {limit}",
            got[i]
        );
    }
    n.handle(
        2,
        NodeInput::Peer {
            from: 0,
            msg: req(2),
        },
    );
    let again = sizes(&mut n);
    assert_eq!(again[0], got[0], "a new stream starts small again");
    assert_eq!(
        catchup_chunk_bytes(1000, 0),
        1000,
        "never above the configured size"
    );
    assert!(
        catchup_chunk_bytes(usize::MAX, 1000) >= catchup_chunk_bytes(usize::MAX, 10),
        "no overflow"
    );
}

/// A window of 1 is the strictly serial copy: the next chunk only once this one is durable.
#[test]
fn catchup_window_of_one_waits_for_durability() {
    let (mut n, outs) = recovering_node(1);
    let st = catchup_reqs(&outs)[0].1;
    assert_eq!(catchup_reqs(&outs)[0].3, 1);
    n.handle(
        10,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, None, Some("a"), vec![entry("a", 1), entry("b", 1)]),
        },
    );
    let outs = n.take_outputs();
    let seqs = persists(&outs);
    assert_eq!(seqs.len(), 1, "a chunk's records are one append: {outs:?}");
    let recs = outs.iter().find_map(|o| match o {
        Output::PersistChunk { puts, .. } => Some(puts.records().len()),
        _ => None,
    });
    assert_eq!(recs, Some(4), "a Put and a Mark per committed entry");
    assert!(credits(&outs).is_empty());
    n.handle(11, NodeInput::Persisted(vec![seqs[0] + 100]));
    assert!(
        credits(&n.take_outputs()).is_empty(),
        "another append's completion is not enough"
    );
    n.handle(12, NodeInput::Persisted(vec![seqs[0]]));
    assert_eq!(credits(&n.take_outputs()), vec![(st, 1)]);
}

/// A key of a key-ordered chunk takes its durable version when applied, without a second
/// lookup when the chunk completes, so until then nothing may rely on it: an INV of that
/// version gets its ACK_P only once the chunk is durable, while a newer version's own
/// append is enough for its ACK_P.
#[test]
fn pending_chunk_defers_ack_p_until_durable() {
    let (mut n, outs) = recovering_node(4);
    let st = catchup_reqs(&outs)[0].1;
    n.handle(
        10,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, None, Some("b"), vec![entry("a", 5), entry("b", 5)]),
        },
    );
    let chunk_seq = persists(&n.take_outputs())[0];
    let ack_ps = |outs: &[Output]| -> Vec<(Vec<u8>, Ts)> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Send {
                    to: 2,
                    msg:
                        PeerMsg::Ack {
                            key, ts, p: true, ..
                        },
                } => Some((key.clone(), *ts)),
                _ => None,
            })
            .collect()
    };
    // A replay of a's version by node 2: the chunk holding it is not durable yet.
    let v5 = Ts {
        version: 5,
        node: 2,
    };
    n.handle(
        11,
        NodeInput::Peer {
            from: 2,
            msg: PeerMsg::Inv {
                epoch: 2,
                key: b"a".to_vec(),
                ts: v5,
                value: b"v".to_vec(),
            },
        },
    );
    let outs = n.take_outputs();
    assert!(
        ack_ps(&outs).is_empty(),
        "no ACK_P before the chunk is durable: {outs:?}"
    );
    // A newer version of b: its own append makes it durable, chunk or not.
    let v6 = Ts {
        version: 6,
        node: 2,
    };
    n.handle(
        12,
        NodeInput::Peer {
            from: 2,
            msg: PeerMsg::Inv {
                epoch: 2,
                key: b"b".to_vec(),
                ts: v6,
                value: b"w".to_vec(),
            },
        },
    );
    let b_seq = persists(&n.take_outputs())[0];
    n.handle(13, NodeInput::Persisted(vec![b_seq]));
    assert_eq!(ack_ps(&n.take_outputs()), vec![(b"b".to_vec(), v6)]);
    // The chunk completes: a's owed ACK_P goes.
    n.handle(14, NodeInput::Persisted(vec![chunk_seq]));
    assert_eq!(ack_ps(&n.take_outputs()), vec![(b"a".to_vec(), v5)]);
    assert!(n.durable_watch.is_empty());
}

/// A Buddy and a recovering node wired together, with a log that completes one append only
/// every few steps (a slow receiver): the Buddy is never sent more than the window ahead
/// of the log (chunks in flight plus received-not-durable never exceed it), the stream is
/// opened once and fed by credits, and the whole store arrives.
#[test]
fn credit_flow_with_a_slow_receiver() {
    const KEYS: usize = 400;
    let window = 4usize;
    let mut buddy = full_copy_buddy(KEYS, 100); // about 3 entries per chunk
    let (mut rec, outs) = recovering_node(window);
    let mut to_buddy: VecDeque<PeerMsg> = VecDeque::new();
    let mut to_rec: VecDeque<PeerMsg> = VecDeque::new();
    let mut log: VecDeque<u64> = VecDeque::new();
    let (mut reqs, mut credit_msgs, mut ended) = (0, 0, false);
    let mut route = |outs: Vec<Output>,
                     to_buddy: &mut VecDeque<PeerMsg>,
                     log: &mut VecDeque<u64>,
                     ended: &mut bool| {
        for o in outs {
            match o {
                Output::Send { to: 1, msg } => {
                    match &msg {
                        PeerMsg::CatchUpReq { .. } => reqs += 1,
                        PeerMsg::CatchUpCredit { .. } => credit_msgs += 1,
                        PeerMsg::RecovEnd { .. } => *ended = true,
                        _ => {}
                    }
                    to_buddy.push_back(msg);
                }
                Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => {
                    log.push_back(seq)
                }
                _ => {}
            }
        }
    };
    route(outs, &mut to_buddy, &mut log, &mut ended);
    let mut now = 10;
    for step in 0..100_000 {
        now += 1;
        if let Some(m) = to_buddy.pop_front() {
            buddy.handle(now, NodeInput::Peer { from: 0, msg: m });
        }
        if buddy.wants_pump() {
            buddy.handle(now, NodeInput::Pump);
        }
        for o in buddy.take_outputs() {
            if let Output::Send { to: 0, msg } = o {
                to_rec.push_back(msg);
            }
        }
        if let Some(m) = to_rec.pop_front() {
            rec.handle(now, NodeInput::Peer { from: 1, msg: m });
        }
        // The log: one append completes every 7th step.
        if step % 7 == 0 {
            if let Some(seq) = log.pop_front() {
                rec.handle(now, NodeInput::Persisted(vec![seq]));
            }
        }
        route(rec.take_outputs(), &mut to_buddy, &mut log, &mut ended);
        let in_flight = to_rec
            .iter()
            .filter(|m| matches!(m, PeerMsg::CatchUpResp { .. }))
            .count();
        let unpersisted = match &rec.mode {
            Mode::Recovering(r) => r.chunks_unpersisted.len(),
            _ => 0,
        };
        assert!(in_flight + unpersisted <= window, "step {step}: {in_flight} chunks in flight and {unpersisted} not durable, window {window}");
        if ended {
            break;
        }
    }
    assert!(ended, "the catch-up finished");
    assert_eq!(reqs, 1, "one stream, opened once: credits, not round trips");
    assert!(credit_msgs > 10, "fed by credits: {credit_msgs}");
    for i in 0..KEYS {
        let k = format!("k{i:04}");
        assert_eq!(
            rec.key_ts(k.as_bytes()),
            Ts {
                version: 1,
                node: 1
            },
            "{k}"
        );
    }
}

/// A Buddy that dies mid-stream: no chunk comes for `recovery_retry_us` while credit is
/// out, so the recovering node opens a new stream where it is (late chunks of the old one
/// are ignored); once the CM removes the dead Buddy, recovery restarts with the next one,
/// which completes it.
#[test]
fn buddy_dying_mid_stream_is_replaced() {
    let window = 4;
    let (mut rec, outs) = recovering_node(window);
    let (_, st, _, _) = catchup_reqs(&outs)[0].clone();
    rec.handle(
        10,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, None, Some("k0000"), vec![entry("k0000", 1)]),
        },
    );
    let outs = rec.take_outputs();
    let s0 = persists(&outs);
    rec.handle(11, NodeInput::Persisted(vec![s0[0]]));
    rec.take_outputs();
    // Buddy 1 falls silent. Before the retry timeout nothing happens; after it, a new
    // stream from where we are.
    let retry = rec.p.recovery_retry_us;
    rec.handle(12 + retry / 2, NodeInput::Tick);
    assert!(catchup_reqs(&rec.take_outputs()).is_empty());
    rec.handle(12 + retry, NodeInput::Tick);
    let reqs = catchup_reqs(&rec.take_outputs());
    assert_eq!(reqs.len(), 1);
    let (to, st2, cursor, chunks) = reqs[0].clone();
    assert!(st2 != st);
    assert_eq!(
        (to, cursor, chunks),
        (1, key_cursor(Some("k0000")), window as u32)
    );
    // A late chunk of the dead stream is ignored.
    rec.handle(
        13 + retry,
        NodeInput::Peer {
            from: 1,
            msg: resp(st, Some("k0000"), Some("k0001"), vec![entry("k0001", 1)]),
        },
    );
    assert!(rec.take_outputs().is_empty());
    // The CM removes node 1: recovery restarts (§VI) with Buddy 2, which streams its store.
    rec.handle(
        20 + retry,
        NodeInput::Heartbeat(Heartbeat {
            seq: 1,
            config: Config {
                epoch: 3,
                nodes: vec![0, 1, 2],
                active: [2].into(),
                recovering: [0].into(),
            },
            lease_ref: rec.last_lease_ref(),
        }),
    );
    rec.take_outputs();
    rec.handle(
        21 + retry,
        NodeInput::Peer {
            from: 2,
            msg: PeerMsg::RecovStartAck { epoch: 3 },
        },
    );
    let reqs = catchup_reqs(&rec.take_outputs());
    assert_eq!(reqs.len(), 1);
    let (to, st3, _, _) = reqs[0].clone();
    assert_eq!(to, 2, "the next active node is the Buddy");
    let chunk = Chunk::from_entries(&[entry("k0000", 1), entry("k0001", 2)]);
    rec.handle(
        22 + retry,
        NodeInput::Peer {
            from: 2,
            msg: PeerMsg::CatchUpResp {
                epoch: 3,
                stream: st3,
                from: key_cursor(None),
                next: None,
                full_copy: true,
                entries: chunk,
            },
        },
    );
    let mut outs = rec.take_outputs();
    for _ in 0..10 {
        for s in outs
            .iter()
            .filter_map(|o| match o {
                Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect::<Vec<_>>()
        {
            rec.handle(23 + retry, NodeInput::Persisted(vec![s]));
        }
        let more = rec.take_outputs();
        if sent_recov_end(&more) {
            outs = more;
            break;
        }
        outs = more;
    }
    assert!(
        sent_recov_end(&outs),
        "recovery completed through the new Buddy"
    );
    assert_eq!(
        rec.key_ts(b"k0001"),
        Ts {
            version: 2,
            node: 2
        }
    );
}

/// The invariant checks can fail: a core whose state breaks one panics naming it.
#[test]
fn check_invariants_names_a_broken_invariant() {
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
    n.check_invariants();
    n.pending_client_ops = 3; // counted, yet no op queued on any key
    let e = std::panic::catch_unwind(|| n.check_invariants()).unwrap_err();
    let msg = e.downcast_ref::<String>().unwrap();
    assert!(
        msg.contains("pending_client_ops counts the ops queued"),
        "{msg}"
    );
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
    n.config = cfg(2, &[1, 2], &[0]);
    n.mode = Mode::Member; // a Member the configuration lists as recovering
    let e = std::panic::catch_unwind(|| n.check_invariants()).unwrap_err();
    let msg = e.downcast_ref::<String>().unwrap();
    assert!(
        msg.contains("a Member node is a member of its configuration"),
        "{msg}"
    );
}
