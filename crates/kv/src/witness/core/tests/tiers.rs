//! Tier accounting (`core::tiers`, `node/status.rs`): what each kind of node reports it holds,
//! per tier, as keys are written, overwritten and recovered. The router runs
//! `check_invariants_deep` after every input, so every step below also checks the counters
//! against a recount.

use super::*;
use crate::witness::proto::StatusReport;

const KEYS: usize = 200;
const VALUE_BYTES: usize = 1000;

fn status(r: &mut Router, id: NodeId) -> StatusReport {
    match r.call(id, ClientReq::Status, 10) {
        Some(ClientReply::Status(s)) => *s,
        other => panic!("node {id} answered a status request with {other:?}"),
    }
}

fn key(i: usize) -> String {
    format!("key-{i:04}")
}

#[test]
fn each_role_reports_the_bytes_of_its_own_tiers() {
    let p = Params {
        soft_timeout_us: 0,
        ..params()
    };
    let mut r = Router::with_params(Config::standard(1, 1), p); // P=0, B=1, W=2
    let p = r.wait_serving();
    let value = "v".repeat(VALUE_BYTES);
    for i in 0..KEYS {
        assert_eq!(r.put(p, &key(i), &value), Some(ClientReply::PutOk));
    }
    r.run_for(100); // written back
    let n = KEYS as u64;
    let v = VALUE_BYTES as u64;

    let prim = status(&mut r, 0);
    assert_eq!((prim.kind.as_str(), prim.role.as_str()), ("head", "leader"));
    assert_eq!((prim.keys, prim.values, prim.leader), (n, n, Some(0)));
    let t = prim.tiers;
    // Each value is one malloc chunk of 1008 B + the key's 32 B, plus the table's slots.
    assert!(t.nvmm_value_table_bytes >= n * (1008 + 32), "{t:?}");
    assert!(
        t.nvmm_value_table_bytes <= n * (1008 + 32 + 4 * 64),
        "{t:?}"
    );
    assert!(
        t.nvmm_key_table_bytes >= n * 32 && t.nvmm_key_table_bytes < n * 200,
        "{t:?}"
    );
    assert_eq!(
        (t.dram_index_bytes, t.ssd_allocated_bytes, t.ssd_live_bytes),
        (0, 0, 0)
    );

    let wit = status(&mut r, 2);
    assert_eq!((wit.kind.as_str(), wit.role.as_str()), ("head", "follower"));
    assert_eq!((wit.keys, wit.values, wit.leader), (n, 0, Some(0)));
    assert_eq!(
        wit.tiers.nvmm_value_table_bytes, 0,
        "a witness holds no values"
    );
    assert_eq!(wit.tiers.nvmm_key_table_bytes, t.nvmm_key_table_bytes);

    let b = status(&mut r, 1);
    assert_eq!(b.kind, "backup");
    assert_eq!((b.keys, b.values), (n, 0));
    assert!(b.written_back_through >= n);
    let bt = b.tiers;
    assert_eq!(
        bt.nvmm_key_table_bytes + bt.nvmm_value_table_bytes,
        0,
        "{bt:?}"
    );
    assert!(
        bt.dram_index_bytes >= n * 32 && bt.dram_index_bytes < n * 300,
        "{bt:?}"
    );
    // Every value is on SSD once in the index (the recent-log window names it a second time).
    assert!(
        bt.ssd_live_bytes >= n * v && bt.ssd_live_bytes <= 2 * n * (v + 128),
        "{bt:?}"
    );
    assert!(bt.ssd_allocated_bytes >= n * v, "{bt:?}");

    // Smaller values replace the big ones: the primary's value bytes shrink, its key bytes stay.
    for i in 0..KEYS {
        assert_eq!(r.put(p, &key(i), "s"), Some(ClientReply::PutOk));
    }
    r.run_for(100);
    let after = status(&mut r, 0).tiers;
    assert!(
        after.nvmm_value_table_bytes < n * (32 + 32 + 4 * 64),
        "{after:?}"
    );
    assert_eq!(after.nvmm_key_table_bytes, t.nvmm_key_table_bytes);

    // The witness takes over: its value table grows from nothing as values are pulled back.
    r.crash(0);
    let w = r.wait_serving();
    assert_eq!(w, 2);
    assert!(r.run_until(3_000, |r| r.recovered.contains(&2)));
    let wit = status(&mut r, 2);
    assert_eq!(
        (wit.role.as_str(), wit.values, wit.missing_keys),
        ("leader", n, 0)
    );
    assert!(
        wit.tiers.nvmm_value_table_bytes >= n * (32 + 32),
        "{:?}",
        wit.tiers
    );
}
