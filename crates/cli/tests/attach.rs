//! `volume attach --mkfs`: ext4 over a loop device over the FUSE file over the volume; files
//! written with sync survive detach and re-attach. Needs root, /dev/fuse, losetup, mkfs.ext4;
//! set UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without them.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

fn mounted(dir: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.to_string_lossy();
    text.lines().any(|l| l.split(' ').nth(4) == Some(d.as_ref()))
}

/// Detaches on drop, so a failing test leaves no mount behind.
struct Detach<'a>(&'a Up, &'a Path);

impl Drop for Detach<'_> {
    fn drop(&mut self) {
        if mounted(self.1) {
            let _ = self.0.cli(&["volume", "detach", &self.1.to_string_lossy()]);
        }
        if mounted(self.1) {
            let _ = Command::new("umount").arg("-l").arg(self.1).status();
        }
    }
}

#[test]
fn attach_mkfs_write_detach_reattach_read() {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "attach needs root (or set UNDERSTUDY_SKIP_FUSE_TESTS=1)");
    assert!(Path::new("/dev/fuse").exists(), "attach needs /dev/fuse (or set UNDERSTUDY_SKIP_FUSE_TESTS=1)");

    let up = Up::start(4);
    up.ok(&["volume", "create", "fsvol", "--size", "64M"]);
    let mnt = up.dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mnt = mnt.canonicalize().unwrap();
    let m = mnt.to_string_lossy().into_owned();
    let _guard = Detach(&up, &mnt);

    let out = up.ok(&["volume", "attach", "fsvol", "--mount", &m, "--mkfs"]);
    assert!(out.starts_with("attached fsvol"), "{out}");
    assert!(mounted(&mnt));
    // Attaching twice is refused with a clear error.
    let err = up.fails(&["volume", "attach", "fsvol", "--mount", &m]);
    assert!(err.contains("already attached"), "{err}");

    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(mnt.join("hello.txt"), b"hello from understudy\n").unwrap();
    std::fs::create_dir(mnt.join("sub")).unwrap();
    std::fs::write(mnt.join("sub/data.bin"), &payload).unwrap();
    let st = Command::new("sync").status().unwrap();
    assert!(st.success());

    let out = up.ok(&["volume", "detach", &m]);
    assert!(out.contains("detached"), "{out}");
    assert!(!mounted(&mnt), "still mounted after detach");
    assert!(!mnt.join("hello.txt").exists());

    // Re-attach (no mkfs) and read the files back.
    up.ok(&["volume", "attach", "fsvol", "--mount", &m]);
    assert_eq!(std::fs::read(mnt.join("hello.txt")).unwrap(), b"hello from understudy\n");
    assert_eq!(std::fs::read(mnt.join("sub/data.bin")).unwrap(), payload);
    up.ok(&["volume", "detach", &m]);
    assert!(!mounted(&mnt));
    let err = up.fails(&["volume", "detach", &m]);
    assert!(err.contains("nothing is attached"), "{err}");
}
