//! Reading and writing the local copy of a log file (the shim's own I/O, through glibc's
//! functions).

use super::*;

pub(super) fn read_local(fd: c_int, size: u64) -> std::io::Result<Vec<u8>> {
    read_local_at(fd, 0, size as usize)
}

/// `len` bytes of the local file from `offset` (zeros past its end).
pub(super) fn read_local_at(fd: c_int, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut img = vec![0u8; len];
    let mut done = 0;
    while done < img.len() {
        // SAFETY: reading into our own buffer within its bounds.
        let n = unsafe { libc::pread64(fd, img[done..].as_mut_ptr() as *mut c_void, img.len() - done, (offset + done as u64) as i64) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue; // a signal to the application: not a failed read
            }
            return Err(e);
        }
        if n == 0 {
            break; // shorter than replicated: the rest reads as zeros
        }
        done += n as usize;
    }
    Ok(img)
}

pub(super) fn write_local_all(fd: c_int, data: &[u8], offset: u64) -> std::io::Result<()> {
    // On Linux pwrite on an O_APPEND fd appends whatever the offset (a repair of an
    // application's append-only log fd, Redis's AOF, would land at the end, then be truncated
    // away): the flag is off while the bytes go to their offsets.
    // SAFETY: fcntl on our caller's fd with integer arguments.
    let flags = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_GETFL) } as c_int;
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & libc::O_APPEND != 0 {
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFL, flags & !libc::O_APPEND) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let r = write_at_all(fd, data, offset);
    if flags & libc::O_APPEND != 0 {
        // SAFETY: as above (restores the application's flags).
        unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFL, flags) };
    }
    r
}

pub(super) fn write_at_all(fd: c_int, data: &[u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        // SAFETY: writing from our own buffer within its bounds with the real pwrite.
        let n = unsafe { (real().pwrite)(fd, data[done..].as_ptr() as *const c_void, data.len() - done, (offset + done as u64) as off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue; // a signal to the application: not a failed write
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}
