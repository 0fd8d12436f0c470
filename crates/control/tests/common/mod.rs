//! The store's API checks, run against both backends (tests/embedded.rs, tests/etcd.rs).

#![allow(dead_code)]

use std::time::{Duration, Instant};

use control::{Compare, Error, Op, Store};

/// The lease TTL of the election and liveness checks: etcd's smallest useful one with the test
/// clusters' 500 ms election timeout is 1 s; 2 s leaves a loaded machine's stalls room.
pub const TTL: Duration = Duration::from_secs(2);
/// How long a takeover or an expiry may take: 2× the TTL (the target) plus scheduling slack on a
/// loaded 2-core machine. The failure mode is "never".
pub const TAKEOVER_BOUND: Duration = Duration::from_secs(6);

/// get / put / delete / list / txn, as etcd means them.
pub async fn txn_guards(store: &Store) {
    let a = store.key("volume", "vol", "a");
    let b = store.key("volume", "vol", "b");
    let other = store.key("volume", "job", "x");
    assert_eq!(store.get(&a).await.unwrap(), None);
    let r1 = store.put(&a, b"one".to_vec()).await.unwrap();
    store.put(&b, b"bee".to_vec()).await.unwrap();
    store.put(&other, b"job".to_vec()).await.unwrap();
    let kv = store.get(&a).await.unwrap().unwrap();
    assert_eq!((kv.value.as_slice(), kv.mod_revision, kv.create_revision, kv.version), (&b"one"[..], r1, r1, 1));

    let listed = store.list(&store.prefix("volume", "vol")).await.unwrap();
    assert_eq!(listed.iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(), vec![a.as_str(), b.as_str()]);

    // A decision guarded by what was read commits once; the second, on the same read, fails.
    let guard = vec![Compare::mod_revision(&a, kv.mod_revision)];
    let out = store.txn(guard.clone(), vec![Op::put(&a, b"two".to_vec()), Op::delete(&b)]).await.unwrap();
    assert!(out.succeeded);
    let stale = store.txn(guard, vec![Op::put(&a, b"three".to_vec())]).await.unwrap();
    assert!(!stale.succeeded, "a txn guarded by a stale revision must fail");
    let now = store.get(&a).await.unwrap().unwrap();
    assert_eq!((now.value.as_slice(), now.version, now.create_revision), (&b"two"[..], 2, r1));
    assert_eq!(store.get(&b).await.unwrap(), None, "the txn's delete applied with its put");

    // Epoch values and absence guard too.
    assert!(store.txn(vec![Compare::value(&a, b"two".to_vec())], vec![Op::put(&a, b"2b".to_vec())]).await.unwrap().succeeded);
    assert!(!store.txn(vec![Compare::value(&a, b"two".to_vec())], vec![Op::put(&a, b"x".to_vec())]).await.unwrap().succeeded);
    assert!(!store.txn(vec![Compare::absent(&a)], vec![Op::put(&a, b"x".to_vec())]).await.unwrap().succeeded);
    assert!(store.txn(vec![Compare::absent(&b)], vec![Op::put(&b, b"again".to_vec())]).await.unwrap().succeeded);
    // A key deleted and written again gets a new create revision, above every earlier one.
    assert!(store.get(&b).await.unwrap().unwrap().create_revision > now.mod_revision);

    // Polling a prefix sees a delete, and times out when nothing changes.
    let vols = store.prefix("volume", "vol");
    let before = store.list(&vols).await.unwrap();
    let tick = Duration::from_millis(20);
    assert_eq!(store.poll_prefix(&vols, &before, tick, Duration::from_millis(100)).await.unwrap(), None);
    store.delete(&a).await.unwrap();
    assert_eq!(store.get(&a).await.unwrap(), None);
    let after = store.poll_prefix(&vols, &before, tick, Duration::from_secs(5)).await.unwrap().expect("the delete is seen");
    assert_eq!(after.iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(), vec![b.as_str()]);

    // Bad input: a clear error, nothing written.
    let big = vec![0u8; control::MAX_VALUE_BYTES + 1];
    let e = store.put(&a, big).await.unwrap_err();
    assert!(matches!(e, Error::ValueTooLarge { .. }), "{e}");
    assert!(e.to_string().contains("1.5 MiB"), "{e}");
    assert!(matches!(store.put("no-slash", vec![]).await.unwrap_err(), Error::BadKey { .. }));
    assert!(matches!(store.put("/with space", vec![]).await.unwrap_err(), Error::BadKey { .. }));
    assert_eq!(store.get(&a).await.unwrap(), None);
    // A value at the limit goes through.
    store.put(&a, vec![7u8; control::MAX_VALUE_BYTES]).await.unwrap();
    assert_eq!(store.get(&a).await.unwrap().unwrap().value.len(), control::MAX_VALUE_BYTES);
}

/// Two campaigners: one leader; when its lease is no longer renewed the other takes over within
/// the bound, and the old leadership's writes are refused as Deposed.
pub async fn election_takeover(first: &Store, second: &Store) {
    let one = first.campaign("meta", "host-a:1", TTL).await.unwrap();
    assert!(one.is_leader());
    assert_eq!(first.observe("meta").await.unwrap().as_deref(), Some("host-a:1"));
    let s2 = second.clone();
    let mut standby = tokio::spawn(async move { s2.campaign("meta", "host-b:2", TTL).await });
    // Exactly one leader: the standby waits while the first renews (over two TTLs).
    let waited = tokio::time::timeout(2 * TTL + Duration::from_millis(500), &mut standby).await;
    assert!(waited.is_err(), "the standby became leader while the leader renewed its lease");
    let epoch = first.key("volume", "map", "epoch");
    one.put(&epoch, b"1".to_vec()).await.expect("the leader writes");

    // The leader stalls (stops renewing): the standby takes over within the bound.
    let stalled = Instant::now();
    one.stop_renewing();
    let two = tokio::time::timeout(TAKEOVER_BOUND, standby).await.expect("standby took over within the bound").unwrap().unwrap();
    let took = stalled.elapsed();
    eprintln!("takeover after the leader stopped renewing: {} ms (TTL {} ms)", took.as_millis(), TTL.as_millis());
    assert!(two.is_leader());
    assert!(two.fencing_token() > one.fencing_token(), "the new leader's epoch is above the old one's");
    assert_eq!(second.observe("meta").await.unwrap().as_deref(), Some("host-b:2"));

    // The deposed leader's write fails, distinctly, and names the new leader; nothing written.
    let e = one.put(&epoch, b"stale".to_vec()).await.unwrap_err();
    match &e {
        Error::Deposed { leader, .. } => assert_eq!(leader.as_deref(), Some("host-b:2"), "{e}"),
        other => panic!("expected Deposed, got {other}"),
    }
    assert_eq!(first.get(&epoch).await.unwrap().unwrap().value, b"1");
    two.put(&epoch, b"2".to_vec()).await.expect("the new leader writes");
    // A failed compare of the leader's own is a plain failure, not Deposed.
    let out = two.txn(vec![Compare::value(&epoch, b"1".to_vec())], vec![Op::put(&epoch, b"3".to_vec())]).await.unwrap();
    assert!(!out.succeeded);
    two.resign().await.unwrap();
    assert_eq!(first.observe("meta").await.unwrap(), None);
}

/// A liveness key disappears once its holder stops renewing; the others stay.
pub async fn liveness(store: &Store) {
    let a = store.register("shard", "s1", "10.0.0.1:7000", TTL).await.unwrap();
    let b = store.register("shard", "s2", "10.0.0.2:7000", TTL).await.unwrap();
    assert_eq!(
        store.live("shard").await.unwrap(),
        vec![("s1".to_string(), "10.0.0.1:7000".to_string()), ("s2".to_string(), "10.0.0.2:7000".to_string())]
    );
    // Renewals keep it past its TTL.
    tokio::time::sleep(TTL + TTL / 2).await;
    assert_eq!(store.live("shard").await.unwrap().len(), 2, "renewed registrations stay");
    let stopped = Instant::now();
    a.stop_renewing();
    loop {
        let live = store.live("shard").await.unwrap();
        if live == vec![("s2".to_string(), "10.0.0.2:7000".to_string())] {
            break;
        }
        assert!(stopped.elapsed() < TAKEOVER_BOUND, "s1 still live {} ms after it stopped renewing: {live:?}", stopped.elapsed().as_millis());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("liveness key gone {} ms after its renewals stopped (TTL {} ms)", stopped.elapsed().as_millis(), TTL.as_millis());
    assert!(b.is_live());
    b.deregister().await.unwrap();
    assert!(store.live("shard").await.unwrap().is_empty());
}
