//! Following the metadata service's leader in the control store (issue 24 §3).
//!
//! Shards and clients reach the metadata service by dialling its addresses in turn (only the
//! leader listens). That alone does not leave a leader that was *paused* or partitioned: its
//! connections stay open, its kernel even accepts new ones, and a shard linked to it never
//! registers with the new leader, which then sees every shard down. So a shard (and a client,
//! [`crate::driver::client::Cluster::connect_following`]) with the control store watches the
//! `volume-meta` election ([`LeaderWatch`]): when the leader's election key changes, it drops
//! its connection and dials again, the new leader's address first. The key, not the address,
//! tells a new leader (a restarted service keeps its address); no leader at all is no change
//! (the old one may serve until its lease ends, and then it exits).

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::meta::META_ELECTION;

/// How often the election is read: well under any election TTL (at least a second).
pub const LEADER_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// The wait before trying to open the store again.
const OPEN_RETRY_INTERVAL: Duration = Duration::from_millis(500);

/// The metadata service's current leader: its election key and the address it advertises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    pub key: String,
    pub addr: String,
}

/// Reads the `volume-meta` election every [`LEADER_POLL_INTERVAL`] in a background task until
/// dropped; the last leader seen is kept while the store cannot be read.
pub struct LeaderWatch {
    rx: watch::Receiver<Option<Leader>>,
    task: JoinHandle<()>,
}

impl LeaderWatch {
    /// Watches the election of cluster `cluster` (identity `cluster_id`) in the store at `url`;
    /// opening the store is retried in the background.
    pub fn spawn(url: String, cluster: String, cluster_id: String) -> LeaderWatch {
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(async move {
            let store = loop {
                match control::Store::open(&url, &cluster, &cluster_id).await {
                    Ok(s) => break s,
                    Err(e) => {
                        tracing::warn!("cannot open the control store {url} to follow the metadata leader: {e}");
                        tokio::time::sleep(OPEN_RETRY_INTERVAL).await;
                    }
                }
            };
            loop {
                match store.leader(META_ELECTION).await {
                    Ok(Some(kv)) => {
                        let l = Leader { addr: String::from_utf8_lossy(&kv.value).into_owned(), key: kv.key };
                        tx.send_if_modified(|cur| {
                            let new = cur.as_ref() != Some(&l);
                            if new {
                                *cur = Some(l.clone());
                            }
                            new
                        });
                    }
                    Ok(None) => {}
                    Err(e) => tracing::debug!("cannot read the metadata election: {e}"),
                }
                tokio::time::sleep(LEADER_POLL_INTERVAL).await;
            }
        });
        LeaderWatch { rx, task }
    }

    /// The leader last seen, if any.
    pub fn current(&self) -> Option<Leader> {
        self.rx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Leader>> {
        self.rx.clone()
    }
}

impl Drop for LeaderWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until a leader other than the one with key `from` is seen (any leader, if `from` is
/// None); never returns if the watch ends.
pub async fn changed_from(rx: &mut watch::Receiver<Option<Leader>>, from: Option<&str>) -> Leader {
    loop {
        if let Some(l) = rx.borrow_and_update().clone() {
            if Some(l.key.as_str()) != from {
                return l;
            }
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// `addrs` (comma-separated) in the order to dial them: the leader's address first when it is
/// one of them (a leader advertising a name, not an address, changes nothing).
pub fn order_addrs(addrs: &str, leader: Option<&Leader>) -> String {
    let mut list: Vec<&str> = addrs.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
    if let Some(i) = leader.and_then(|l| list.iter().position(|a| *a == l.addr)) {
        let first = list.remove(i);
        list.insert(0, first);
    }
    list.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_is_dialled_first() {
        let l = |a: &str| Leader { key: "k".into(), addr: a.into() };
        assert_eq!(order_addrs("a:1, b:2,c:3", Some(&l("c:3"))), "c:3,a:1,b:2");
        assert_eq!(order_addrs("a:1,b:2", Some(&l("meta-b"))), "a:1,b:2");
        assert_eq!(order_addrs("a:1,b:2", None), "a:1,b:2");
    }

    #[tokio::test]
    async fn only_another_leaders_key_is_a_change() {
        let (tx, mut rx) = watch::channel(None);
        let l = |k: &str| Leader { key: k.into(), addr: "x".into() };
        tx.send(Some(l("k1"))).unwrap();
        assert_eq!(changed_from(&mut rx, None).await, l("k1"));
        let waiting = tokio::spawn(async move { changed_from(&mut rx, Some("k1")).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(None).unwrap();
        tx.send(Some(l("k1"))).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "the same leader, or none, is no change");
        tx.send(Some(l("k2"))).unwrap();
        assert_eq!(waiting.await.unwrap(), l("k2"));
    }
}
