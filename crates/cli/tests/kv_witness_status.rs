//! `understudy kv status` on a real witness group (`kv up --protocol witness`: primary, backup,
//! witness as processes): after N keys of V bytes are loaded and written back, each node reports
//! the bytes of its own tiers, within sane bounds of N × V: the primary holds the values in its
//! (NVMM) value table, the witness only keys and stamps, the backup the values on SSD with a
//! DRAM index. `--json` parses, the table names every node.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};


mod witness_group;
use witness_group::*;

const KEYS: u64 = 2_000;
const VALUE_BYTES: u64 = 1_000;

fn status(cluster: &Path, json: bool) -> std::process::Output {
    let mut args = vec!["kv", "status", "--cluster", cluster.to_str().unwrap()];
    if json {
        args.push("--json");
    }
    Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn status_json(cluster: &Path) -> serde_json::Value {
    let out = status(cluster, true);
    assert!(
        out.status.success(),
        "kv status --json: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("kv status --json prints JSON")
}

fn node(v: &serde_json::Value, id: u64) -> &serde_json::Value {
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("node {id} missing: {v}"))
}

fn u(n: &serde_json::Value, path: &[&str]) -> u64 {
    let mut x = n;
    for p in path {
        x = &x[*p];
    }
    x.as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {n}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_each_roles_tier_bytes_within_bounds_of_the_data() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir: PathBuf = t.path().join("group");
    let _up = start(&dir, &[]);
    let (f, secret) = wait_ready(&dir);
    let cluster = dir.join("kv-cluster.json");
    let mut cl = f.client(secret);
    let value = vec![b'v'; VALUE_BYTES as usize];
    for i in 0..KEYS {
        cl.put(format!("key-{i:06}").as_bytes(), &value)
            .await
            .unwrap();
    }
    // Wait until the backup (node 1) has written back everything committed and the leader
    // serves with its whole table. On a loaded machine a spurious election may move the lead
    // to the witness (node 2): then the old primary follows without values and the new one
    // holds them once its recovery ends, so roles are read from the reports, not assumed.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = status_json(&cluster);
        let b = node(&v, 1);
        let leader_full = v["nodes"].as_array().unwrap().iter().any(|n| {
            n["role"] == "leader"
                && n["serving"] == true
                && n["recovering"] == false
                && u(n, &["values"]) >= KEYS
        });
        if leader_full
            && u(b, &["written_back_through"]) >= u(b, &["commit"])
            && u(b, &["keys"]) >= KEYS
        {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the backup did not write back or no leader serves a full table: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(v["unreachable"].as_array().unwrap().is_empty(), "{v}");
    let (n, val) = (KEYS, VALUE_BYTES);
    let leader = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["role"] == "leader")
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    assert!(leader == 0 || leader == 2, "a backup leads: {v}");
    let witness = 2 - leader;

    // The primary (leading head): every value in its value table, once.
    let p = node(&v, leader);
    assert_eq!(
        (p["kind"].as_str(), p["leader"].as_u64()),
        (Some("head"), Some(leader)),
        "{p}"
    );
    assert!(u(p, &["keys"]) >= n && u(p, &["values"]) >= n, "{p}");
    let pv = u(p, &["tiers", "nvmm_value_table_bytes"]);
    assert!(
        pv >= n * val && pv <= 2 * n * val,
        "primary value table {pv} B for {n} × {val} B: {p}"
    );
    assert_eq!(u(p, &["tiers", "ssd_allocated_bytes"]), 0, "{p}");
    assert_eq!(u(p, &["tiers", "dram_index_bytes"]), 0, "{p}");

    // The other head, a witness: keys and stamps only, a small fraction of the data.
    let w = node(&v, witness);
    assert_eq!(
        (w["kind"].as_str(), w["role"].as_str()),
        (Some("head"), Some("follower")),
        "{w}"
    );
    assert_eq!(
        (
            u(w, &["values"]),
            u(w, &["tiers", "nvmm_value_table_bytes"])
        ),
        (0, 0),
        "a witness holds no values: {w}"
    );
    let wk = u(w, &["tiers", "nvmm_key_table_bytes"]);
    assert!(
        wk >= n * 16 && wk <= n * val / 4,
        "witness key table {wk} B for {n} keys: {w}"
    );

    // The backup (node 1): the values on SSD, a DRAM index of them, no tables.
    let b = node(&v, 1);
    assert_eq!(b["kind"].as_str(), Some("backup"), "{b}");
    assert_eq!(
        u(b, &["tiers", "nvmm_key_table_bytes"]) + u(b, &["tiers", "nvmm_value_table_bytes"]),
        0,
        "{b}"
    );
    let (live, alloc) = (
        u(b, &["tiers", "ssd_live_bytes"]),
        u(b, &["tiers", "ssd_allocated_bytes"]),
    );
    assert!(
        live >= n * val && live <= 3 * n * val,
        "backup SSD live {live} B for {n} × {val} B: {b}"
    );
    assert!(
        alloc >= n * val,
        "backup SSD files {alloc} B for {n} × {val} B: {b}"
    );
    let idx = u(b, &["tiers", "dram_index_bytes"]);
    assert!(
        idx >= n * 16 && idx <= n * val / 4,
        "backup index {idx} B for {n} keys: {b}"
    );

    for id in 0..3 {
        let s = node(&v, id);
        assert!(u(s, &["rss_bytes"]) > 0, "{s}");
        assert!(u(s, &["tiers", "nvmm_buffer_mapped_bytes"]) > 0, "{s}");
    }

    // The table: a header and one row per node.
    let out = status(&cluster, false);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    eprintln!("{text}");
    assert!(text.starts_with("NODE"), "{text}");
    for (id, kind) in [(0, "head"), (1, "backup"), (2, "head")] {
        assert!(
            text.lines().any(|l| l
                .split_whitespace()
                .take(2)
                .eq([id.to_string().as_str(), kind])),
            "no row for node {id} ({kind}):\n{text}"
        );
    }
}
