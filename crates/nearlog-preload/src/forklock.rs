//! A mutex a forked child can take over.
//!
//! `fork` copies one thread; a lock another thread held at that moment stays held in the child
//! for good (its owner does not exist there), and `std::sync::Mutex` cannot be released or
//! re-made in place. [`ForkLock`] is a futex mutex (the same three-state protocol as std's)
//! that adds what the shim's fork handlers need: locking and unlocking without a guard (the
//! prepare handler takes a lock that the parent or child handler releases), and
//! [`ForkLock::reset_in_child`], which makes the lock free and replaces its data without reading
//! or dropping the old (which another thread may have left half-updated). Neither allocates:
//! a fork handler may run before the allocator's own child handler (jemalloc's, in Redis).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

/// Unlocked / locked / locked with (possible) waiters.
const FREE: u32 = 0;
const LOCKED: u32 = 1;
const CONTENDED: u32 = 2;

pub struct ForkLock<T> {
    state: AtomicU32,
    data: UnsafeCell<T>,
}

// SAFETY: access to `data` is serialized by `state`, as in std's Mutex.
unsafe impl<T: Send> Sync for ForkLock<T> {}
unsafe impl<T: Send> Send for ForkLock<T> {}

pub struct ForkGuard<'a, T> {
    lock: &'a ForkLock<T>,
}

impl<T> ForkLock<T> {
    pub const fn new(v: T) -> ForkLock<T> {
        ForkLock { state: AtomicU32::new(FREE), data: UnsafeCell::new(v) }
    }

    pub fn lock(&self) -> ForkGuard<'_, T> {
        self.lock_raw();
        ForkGuard { lock: self }
    }

    pub fn try_lock(&self) -> Option<ForkGuard<'_, T>> {
        self.state.compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed).ok()?;
        Some(ForkGuard { lock: self })
    }

    /// Takes the lock with no guard: [`ForkLock::unlock_raw`] releases it (the fork handlers).
    pub fn lock_raw(&self) {
        if self.state.compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            return;
        }
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            // SAFETY: FUTEX_WAIT on our own aligned u32; returns at once if it is no longer
            // CONTENDED, on a wake, or on a signal (EINTR): the loop checks again.
            unsafe {
                libc::syscall(libc::SYS_futex, self.state.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, CONTENDED, std::ptr::null::<libc::timespec>());
            }
        }
    }

    /// Releases a lock taken by [`ForkLock::lock_raw`] (by this thread, or in a fork child by
    /// the thread that forked).
    ///
    /// # Safety
    /// The lock is held by the caller.
    pub unsafe fn unlock_raw(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            libc::syscall(libc::SYS_futex, self.state.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1);
        }
    }

    /// In a fork child: the lock is free and holds `v`; the old data is leaked unread (a thread
    /// that no longer exists may have been changing it). Async-signal-safe, allocates nothing.
    ///
    /// # Safety
    /// Only where no other thread can touch the lock: the child side of `fork`.
    pub unsafe fn reset_in_child(&self, v: T) {
        std::ptr::write(self.data.get(), v);
        self.state.store(FREE, Ordering::Relaxed);
    }
}

impl<T> Deref for ForkGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> DerefMut for ForkGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for ForkGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the guard holds the lock.
        unsafe { self.lock.unlock_raw() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_threads_and_a_child_reset_frees_it() {
        static L: ForkLock<u64> = ForkLock::new(0);
        let hs: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..20_000 {
                        *L.lock() += 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*L.lock(), 80_000);
        L.lock_raw();
        assert!(L.try_lock().is_none());
        // SAFETY: no other thread uses L now (stands for the child side of fork).
        unsafe { L.reset_in_child(7) };
        assert_eq!(*L.try_lock().expect("free after a reset"), 7);
    }
}
