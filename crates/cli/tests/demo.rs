//! `understudy demo` runs end to end and exits 0 only when every check held.

mod common;

use std::process::Command;

use common::*;

#[test]
fn demo_exits_zero() {
    require_qemu();
    let o = Command::new(BIN).arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("→ promoted"), "{stdout}");
    assert!(stdout.contains("→ rejected"), "{stdout}");
    assert!(stdout.contains("checks held"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // Then the failover part: SQLite killed, the backup promoted, no acknowledged commit lost.
    assert!(stdout.contains("demo ok: the backup was promoted"), "{stdout}");
    // Cleans up after itself.
    let dir = stdout.lines().next().and_then(|l| l.rsplit_once("data in ")).map(|(_, d)| d.trim_end_matches(')').to_string()).unwrap();
    assert!(!std::path::Path::new(&dir).exists(), "{dir} left behind");
}
