//! Where an application's recovery on a new instance goes, from the instance's start to its
//! first good health check: the pool's queue, the attach helper's steps (volume open, FUSE
//! mount, `losetup`, `mount` — which replays the ext4 journal after an unclean stop), the
//! application's spawn, its interpreter start, the database's own recovery (SQLite's open,
//! which replays its WAL), and from serving to the first health check that passed. The SQLite
//! front prints its times in its log; the pool keeps the rest ([`StartTiming`]).

use std::path::Path;

use ::failover::pool::StartTiming;

/// The parts, in ms; they add up to start → healthy (less any recovery delay of the bench).
#[derive(Clone, Debug, Default)]
pub struct Breakdown {
    /// Start asked → the pool ran it (the pool works one operation at a time).
    pub queue_ms: f64,
    pub open_ms: f64,
    pub fuse_ms: f64,
    pub losetup_ms: f64,
    /// `mount`: ext4 journal replay after an unclean stop.
    pub mount_ms: f64,
    /// The attach helper's start and what its steps do not cover.
    pub attach_rest_ms: f64,
    /// Attached → the application's process spawned (its network namespace).
    pub spawn_ms: f64,
    /// Spawned → the interpreter runs (`understudy failover sqlite-front` execs python3).
    pub app_boot_ms: f64,
    /// SQLite's open: its own recovery (WAL index rebuilt from the WAL).
    pub app_open_ms: f64,
    /// Serving → the first health check that passed (ping interval, the check itself).
    pub serve_to_healthy_ms: f64,
}

/// The parts' names, in [`Breakdown::values`] order.
pub const PARTS: [&str; 10] =
    ["queue", "volume_open", "fuse_mount", "losetup", "ext4_mount", "attach_rest", "spawn", "app_boot", "app_open", "serve_to_healthy"];

impl Breakdown {
    pub fn values(&self) -> [f64; 10] {
        [
            self.queue_ms,
            self.open_ms,
            self.fuse_ms,
            self.losetup_ms,
            self.mount_ms,
            self.attach_rest_ms,
            self.spawn_ms,
            self.app_boot_ms,
            self.app_open_ms,
            self.serve_to_healthy_ms,
        ]
    }

    /// One line: `queue 0 open 3 … ms`.
    pub fn line(&self) -> String {
        PARTS.iter().zip(self.values()).map(|(n, v)| format!("{n} {v:.0}")).collect::<Vec<_>>().join(" ")
    }
}

/// `(started_unix, opened_unix, serving_unix)` in ms from the SQLite front's last start in its
/// log (`None` for another application, or a log without them).
fn sqlite_times(app_log: &Path) -> Option<(f64, f64, f64)> {
    let text = std::fs::read_to_string(app_log).ok()?;
    let field = |line: &str, key: &str| -> Option<f64> {
        let rest = line.split(key).nth(1)?;
        rest.split([' ', ')']).find(|w| !w.is_empty())?.parse::<f64>().ok().map(|s| s * 1000.0)
    };
    let open_line = text.lines().rev().find(|l| l.contains("opened_unix"))?;
    let serve_line = text.lines().rev().find(|l| l.contains("serving_unix"))?;
    Some((field(open_line, "started_unix ")?, field(open_line, "opened_unix ")?, field(serve_line, "serving_unix ")?))
}

/// The breakdown of one start: asked at `asked_unix_ms`, healthy at `healthy_unix_ms`, with
/// `delay_ms` of recovery the bench added between SQLite's open and serving.
pub fn of(asked_unix_ms: f64, healthy_unix_ms: f64, t: &StartTiming, app_log: &Path, delay_ms: f64) -> Option<Breakdown> {
    if t.requested_unix_ms == 0 {
        return None;
    }
    let step = |n: &str| t.attach_steps_ms.iter().find(|(k, _)| k == n).map_or(0.0, |(_, v)| *v);
    let attach = t.attached_unix_ms as f64 - t.requested_unix_ms as f64;
    let steps: f64 = t.attach_steps_ms.iter().map(|(_, v)| v).sum();
    let mut b = Breakdown {
        queue_ms: t.requested_unix_ms as f64 - asked_unix_ms,
        open_ms: step("open"),
        fuse_ms: step("fuse"),
        losetup_ms: step("losetup"),
        mount_ms: step("mount") + step("mkfs"),
        attach_rest_ms: attach - steps,
        spawn_ms: t.spawned_unix_ms as f64 - t.attached_unix_ms as f64,
        ..Breakdown::default()
    };
    match sqlite_times(app_log) {
        Some((started, opened, serving)) => {
            b.app_boot_ms = started - t.spawned_unix_ms as f64;
            b.app_open_ms = opened - started;
            b.serve_to_healthy_ms = healthy_unix_ms - serving;
            // What lies between open and serving beyond the bench's delay (table setup).
            b.app_open_ms += (serving - opened - delay_ms).max(0.0);
        }
        // Another application: all of it from spawn to healthy.
        None => b.app_open_ms = healthy_unix_ms - t.spawned_unix_ms as f64 - delay_ms,
    }
    Some(b)
}

/// Rows the SQLite front found at its last open (`open with N rows`), from its log.
pub fn sqlite_rows(app_log: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(app_log).ok()?;
    let line = text.lines().rev().find(|l| l.contains("opened_unix"))?;
    line.split(" open with ").nth(1)?.split_whitespace().next()?.parse().ok()
}

/// The wall-clock bounds (unix ms) of a start's phases, for cutting the shards' counters:
/// asked, attached (volume open, FUSE, `losetup`, ext4 `mount`), the interpreter up (spawn,
/// boot), SQLite open (its recovery and table setup; the bench's delay excluded), healthy.
/// `None` without the SQLite front's times.
pub fn phase_bounds(asked_unix_ms: f64, healthy_unix_ms: f64, t: &StartTiming, app_log: &Path, delay_ms: f64) -> Option<[f64; 5]> {
    if t.requested_unix_ms == 0 {
        return None;
    }
    let (started, _opened, serving) = sqlite_times(app_log)?;
    Some([asked_unix_ms.min(t.requested_unix_ms as f64), t.attached_unix_ms as f64, started, serving - delay_ms, healthy_unix_ms])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_add_up_and_the_front_log_parses() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("i2.log");
        std::fs::write(
            &log,
            "sqlite front: /m/app.db open with 3 rows in 0.010 s (started_unix 1000.0500 opened_unix 1000.0600)\n\
             sqlite front: recovering for 100 ms more\n\
             sqlite front: serving on 10.0.0.2:5 (serving_unix 1000.1650)\n",
        )
        .unwrap();
        let t = StartTiming {
            requested_unix_ms: 1_000_005,
            attached_unix_ms: 1_000_030,
            spawned_unix_ms: 1_000_032,
            attach_steps_ms: vec![("open".into(), 5.0), ("fuse".into(), 1.0), ("losetup".into(), 4.0), ("mount".into(), 10.0)],
        };
        let b = of(1_000_000.0, 1_000_180.0, &t, &log, 100.0).unwrap();
        let sum: f64 = b.values().iter().sum();
        assert!((sum - (180.0 - 100.0)).abs() < 1e-6, "{b:?}");
        assert!((b.app_boot_ms - 18.0).abs() < 1e-6 && (b.app_open_ms - 15.0).abs() < 1e-6 && (b.serve_to_healthy_ms - 15.0).abs() < 1e-6, "{b:?}");
        assert!((b.attach_rest_ms - 5.0).abs() < 1e-6);
        assert_eq!(sqlite_rows(&log), Some(3.0));
        let pb = phase_bounds(1_000_000.0, 1_000_180.0, &t, &log, 100.0).unwrap();
        assert!(pb.windows(2).all(|w| w[0] <= w[1]), "{pb:?}");
    }
}
