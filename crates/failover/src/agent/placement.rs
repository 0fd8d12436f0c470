//! Where the monitor starts an instance: the placement decision, kept out of the pool's I/O so
//! it can be tested on its own.

use std::collections::BTreeMap;

/// The host for a new instance, among the hosts whose agents are `live`, given the hosts of
/// the instances still running (`occupied`: the primary, while its backup is placed).
///
/// A live host that holds no running instance comes first: the backup must not share the
/// primary's host, or losing that one machine loses both (the point of an agent per host).
/// Among those, the least loaded, then by name (deterministic, so a repeated decision agrees).
/// When every live host already holds one, the least loaded of them is still chosen: a backup
/// next to the primary protects against the application dying, which is better than no
/// failover at all. None without a live host.
pub fn place(live: &[String], occupied: &[String]) -> Option<String> {
    let mut load: BTreeMap<&str, usize> = live.iter().map(|h| (h.as_str(), 0)).collect();
    for h in occupied {
        if let Some(n) = load.get_mut(h.as_str()) {
            *n += 1;
        }
    }
    // BTreeMap iterates by name: min_by_key keeps the first of equals.
    load.into_iter().min_by_key(|(_, n)| *n).map(|(h, _)| h.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn the_backup_goes_to_another_live_host_than_the_primary() {
        let live = v(&["h0", "h1", "h2"]);
        assert_eq!(place(&live, &[]), Some("h0".into()));
        assert_eq!(place(&live, &v(&["h0"])), Some("h1".into()));
        assert_eq!(place(&live, &v(&["h1"])), Some("h0".into()));
        assert_eq!(place(&live, &v(&["h0", "h1"])), Some("h2".into()));
        // The primary's host died: whatever is live and free.
        assert_eq!(place(&v(&["h1", "h2"]), &v(&["h0"])), Some("h1".into()));
        // A dead host's leftovers do not count against a live one.
        assert_eq!(place(&v(&["h2"]), &v(&["h0", "h1"])), Some("h2".into()));
    }

    #[test]
    fn with_every_live_host_occupied_the_least_loaded_one_is_chosen() {
        assert_eq!(place(&v(&["h0"]), &v(&["h0"])), Some("h0".into()));
        assert_eq!(place(&v(&["h0", "h1"]), &v(&["h0", "h0", "h1"])), Some("h1".into()));
        assert_eq!(place(&[], &v(&["h0"])), None);
    }
}
