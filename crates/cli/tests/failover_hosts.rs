//! Failover across hosts (issue 24, item 5), on [`testbed::hostbed`]: three hosts (network
//! namespaces) each with an etcd member, a metadata service and a shard of the volume system,
//! and a failover agent (`failover agent`); monitors (`failover run --store … --agents`) and
//! client endpoints (`failover endpoint`) on the hosts; the SQLite front as the application,
//! under the load generator from the client host through an endpoint on a surviving host.
//!
//! * The primary's host dies (every process in it SIGKILLed, its link cut): the monitor on
//!   another host promotes the backup, which runs on a third host; the endpoint re-points; no
//!   acknowledged commit is lost. The time from the host's death to the first commit the
//!   promoted primary acknowledges is printed (`failover.host_loss.serving_ms`).
//! * The host of the leading monitor *and* the primary dies: a standby monitor on another host
//!   takes over, finds the placement the dead leader recorded, and fails over the same way.
//!
//! Root only (network namespaces, FUSE, loop devices): skipped otherwise, with a message; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without FUSE.

use std::sync::Mutex;

use testbed::failover_hosts::lose_the_primarys_host;
use testbed::hostbed::{HostBed, ELECTION_TTL};

const BIN: &str = env!("CARGO_BIN_EXE_understudy");

/// One bed at a time: each is 3 etcd members and a dozen daemons on a loaded 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn bed() -> Option<(std::sync::MutexGuard<'static, ()>, HostBed)> {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return None;
    }
    if let Err(e) = testbed::hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Some((g, HostBed::start(BIN.as_ref()).expect("host bed with etcd")))
}

/// The scenario ([`lose_the_primarys_host`], shared with `bench control failover`): the
/// primary on one host, the load through an endpoint on another; that host killed (with the
/// leading monitor when `with_monitor`); the backup promoted on a third host; the endpoint
/// re-pointed; nothing acknowledged lost. Any of these failing is an error.
fn lose(with_monitor: bool) {
    let Some((_serial, bed)) = bed() else { return };
    let r = bed
        .in_client(|| lose_the_primarys_host(&bed, with_monitor, ELECTION_TTL))
        .unwrap();
    let r = r.unwrap_or_else(|e| panic!("{e:#}"));
    assert_ne!(r.to, r.from, "{r:?}");
    let mut v = serde_json::to_value(&r).unwrap();
    v["figure"] = "failover.host_loss.serving_ms".into();
    eprintln!("{v}");
}

/// The primary's host dies under load: the monitor (on another host) promotes the backup on a
/// third host, the endpoint on a surviving host re-points, no acknowledged commit is lost.
#[test]
fn losing_the_primarys_host_promotes_the_backup_on_another_host() {
    lose(false);
}

/// The host of the leading monitor and of the primary dies under load: the standby monitor on
/// another host takes over, knows where the instances were from the recorded placement, and
/// fails over the same way.
#[test]
fn losing_the_host_of_the_leading_monitor_and_the_primary() {
    lose(true);
}
