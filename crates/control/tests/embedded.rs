//! The store's API on the embedded backend (files under a directory, one process).

mod common;

use control::{Error, Op, Store};

async fn open(dir: &std::path::Path, id: &str) -> Result<Store, Error> {
    Store::open(dir.to_str().unwrap(), "test", id).await
}

#[tokio::test]
async fn embedded_txn_guards() {
    let dir = tempfile::tempdir().unwrap();
    common::txn_guards(&open(dir.path(), "id-1").await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_election_takeover() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), "id-1").await.unwrap();
    common::election_takeover(&store, &store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_liveness() {
    let dir = tempfile::tempdir().unwrap();
    common::liveness(&open(dir.path(), "id-1").await.unwrap()).await;
}

/// Two opens of one directory: the second is refused while the first holds it, with an error
/// that says so; after the first closes, it opens.
#[tokio::test]
async fn embedded_lock_refuses_a_second_opener() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), "id-1").await.unwrap();
    let e = open(dir.path(), "id-1").await.err().expect("second open refused");
    assert!(matches!(e, Error::Locked { .. }), "{e}");
    assert!(e.to_string().contains("in use by another process"), "{e}");
    drop(first);
    open(dir.path(), "id-1").await.unwrap();
}

/// Another cluster's store is refused, naming both ids; the store is left as it was.
#[tokio::test]
async fn embedded_refuses_another_clusters_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), "cluster-A").await.unwrap();
    store.put(&store.key("volume", "vol", "v"), b"A's".to_vec()).await.unwrap();
    drop(store);
    let e = open(dir.path(), "cluster-B").await.err().expect("another cluster's store refused");
    assert!(matches!(e, Error::ForeignCluster { .. }), "{e}");
    assert!(e.to_string().contains("cluster-A") && e.to_string().contains("cluster-B"), "{e}");
    let store = open(dir.path(), "cluster-A").await.unwrap();
    assert_eq!(store.get(&store.key("volume", "vol", "v")).await.unwrap().unwrap().value, b"A's");
}

/// Reopening keeps values and revisions; revisions never go back (not even when the newest key
/// was deleted); keys under a lease are gone (their holder was the process that closed).
#[tokio::test]
async fn embedded_reopen_keeps_keys_and_revisions() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), "id").await.unwrap();
    let k = store.key("kv", "config", "c1");
    let gone = store.key("kv", "config", "c2");
    store.put(&k, b"epoch-7".to_vec()).await.unwrap();
    let written = store.get(&k).await.unwrap().unwrap();
    let last = store.put(&gone, b"x".to_vec()).await.unwrap();
    let deleted_at = store.delete(&gone).await.unwrap();
    assert!(deleted_at > last);
    let _member = store.register("peer", "p1", "127.0.0.1:1", common::TTL).await.unwrap();
    assert_eq!(store.live("peer").await.unwrap().len(), 1);
    drop(_member);
    drop(store);
    // The renewal task holds a clone of the store until the runtime drops it, at its next turn.
    tokio::task::yield_now().await;

    let store = open(dir.path(), "id").await.unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap(), written);
    assert!(store.live("peer").await.unwrap().is_empty(), "a leased key outlived its process");
    let again = store.txn(vec![], vec![Op::put(&gone, b"y".to_vec())]).await.unwrap().revision;
    assert!(again > deleted_at, "revision went back after reopen: {again} <= {deleted_at}");
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("keys")).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with('.')).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// A corrupt key file is reported by path at open, not read as a value.
#[tokio::test]
async fn embedded_corrupt_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), "id").await.unwrap();
    store.put(&store.key("volume", "vol", "v"), b"value".to_vec()).await.unwrap();
    drop(store);
    let file = dir.path().join("keys").join("+understudy+test+volume+vol+v");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 6] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let e = open(dir.path(), "id").await.err().expect("corrupt file refused");
    assert!(matches!(e, Error::Corrupt { .. }) && e.to_string().contains("+understudy+test+volume+vol+v"), "{e}");
}

/// A leader whose process was paused past its lease (here: its only thread blocked, so the
/// renewal task cannot run) is no leader the moment it looks, before its renewal task has run
/// again: `is_leader` reads the lease's deadline by the clock, not only the task's verdict.
/// (Before: it said true until the task ran, so a woken metadata service could answer one
/// request from a state a new leader may have changed.)
#[tokio::test(flavor = "current_thread")]
async fn a_leader_paused_past_its_lease_knows_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), "id-1").await.unwrap();
    let lead = store.campaign("e", "me", std::time::Duration::from_secs(1)).await.unwrap();
    assert!(lead.is_leader());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(!lead.is_leader(), "a lease 1.5 s without renewal (TTL 1 s) is not held");
}
