//! The failover monitor's part of `bench control failover`: the host of the primary lost
//! (`failover.host_loss.serving_ms`), and the host of the leading monitor lost with it
//! (`takeover_vs_lease_ttl.failover_monitor`). Both run the `failover_hosts` test's scenario
//! ([`testbed::failover_hosts::lose_the_primarys_host`]) on a fresh [`HostBed`] each: a monitor
//! leader and a standby on the store, an agent per host, the SQLite front under `failover load`
//! through an endpoint on a surviving host.
//!
//! The takeover figure is from the host's death to the promotion the standby performs (the
//! next failover decision served), over the election TTL: the standby must first see the
//! dead leader's lease expire, then detect the primary's silence itself, then super, start and
//! collapse. The standby's `leading` is reported beside it (its election alone).

use std::time::Duration;

use testbed::failover_hosts::{lose_the_primarys_host, HostLoss};
use testbed::hostbed::HostBed;

use super::{failed, figure_spread, ms};

/// Measures `reps` losses of each kind wanted; returns the CSV rows (part, rep, what, value,
/// load).
pub(super) fn measure(
    reps: usize,
    ttl: Duration,
    host_loss: bool,
    monitor_loss: bool,
    report: &mut bench::Report,
    failures: &mut Vec<String>,
) -> anyhow::Result<Vec<Vec<String>>> {
    let mut rows = vec![];
    for (wanted, with_monitor, name) in [
        (host_loss, false, "failover_host"),
        (monitor_loss, true, "failover_monitor"),
    ] {
        if !wanted {
            continue;
        }
        let mut runs: Vec<HostLoss> = vec![];
        for rep in 0..reps {
            eprintln!(
                "{} {}/{reps}",
                if with_monitor {
                    "the leading failover monitor's and the primary's host loss"
                } else {
                    "the primary's host loss"
                },
                rep + 1
            );
            match one(with_monitor, ttl) {
                Ok(r) => {
                    eprintln!("{}", serde_json::to_string(&r)?);
                    let mut row = |what: &str, v: Option<u64>| {
                        if let Some(v) = v {
                            rows.push(vec![
                                name.into(),
                                rep.to_string(),
                                what.into(),
                                v.to_string(),
                                r.loadavg_at_kill.clone(),
                            ]);
                        }
                    };
                    row("serving_ms", Some(r.serving_ms));
                    row("promoted_ms", Some(r.promoted_ms));
                    row("leading_ms", r.leading_ms);
                    row("detect_ms", r.detect_ms);
                    row("super_ms", r.super_ms);
                    row("start_ms", r.start_ms);
                    row("collapse_ms", r.collapse_ms);
                    runs.push(r);
                }
                Err(e) => failed(failures, &format!("{name} repetition {rep}"), e),
            }
        }
        if runs.is_empty() {
            continue;
        }
        let all = |f: fn(&HostLoss) -> Option<u64>| -> Vec<f64> {
            runs.iter().filter_map(f).map(|v| v as f64).collect()
        };
        let prefix = if with_monitor {
            "failover.monitor_host_loss"
        } else {
            "failover.host_loss"
        };
        let serving = figure_spread(
            report,
            &format!("{prefix}.serving_ms"),
            &all(|r| Some(r.serving_ms)),
        )?;
        for (what, v) in [
            ("detect_ms", all(|r| r.detect_ms)),
            ("super_ms", all(|r| r.super_ms)),
            ("start_ms", all(|r| r.start_ms)),
            ("collapse_ms", all(|r| r.collapse_ms)),
        ] {
            if !v.is_empty() {
                figure_spread(report, &format!("{prefix}.breakdown.{what}"), &v)?;
            }
        }
        if with_monitor {
            let decision = figure_spread(
                report,
                "takeover.failover_monitor.decision_ms",
                &all(|r| Some(r.promoted_ms)),
            )?;
            report.ratio("takeover_vs_lease_ttl.failover_monitor", decision, ms(ttl))?;
            let leading = all(|r| r.leading_ms);
            if !leading.is_empty() {
                figure_spread(report, "takeover.failover_monitor.leading_ms", &leading)?;
            }
        } else {
            report.figure("failover.host_loss.serving_ms", serving)?;
        }
    }
    Ok(rows)
}

/// One loss on a fresh bed; the bed is started on this thread (its daemons die with it) and
/// the scenario runs on its client host.
fn one(with_monitor: bool, ttl: Duration) -> anyhow::Result<HostLoss> {
    testbed::hosts::available()?;
    let bed = HostBed::start(&std::env::current_exe()?)?;
    bed.in_client(|| lose_the_primarys_host(&bed, with_monitor, ttl))?
}
