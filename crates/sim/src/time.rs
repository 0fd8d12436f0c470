//! Virtual time: [`TimeUs`] and the bounded [`EventQueue`] that drives a simulation.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;

/// Virtual time in microseconds since the start of the simulation. There is no real clock.
pub type TimeUs = u64;

/// The queue already holds `max_events` events; see [`EventQueue::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFull {
    pub max_events: usize,
}

impl fmt::Display for QueueFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "event queue full: {} events already queued (max_events, set in EventQueue::new); the \
             simulation produces events faster than it consumes them: look for a message or timer \
             storm, or raise max_events",
            self.max_events
        )
    }
}

impl std::error::Error for QueueFull {}

/// Pending events ordered by `(time, insertion sequence)`: the earliest event pops first, and
/// events scheduled for the same time pop in the order they were pushed. That tie-break is what
/// makes a run reproducible.
///
/// The queue also keeps the simulation clock: [`EventQueue::now`] is the time of the last popped
/// event, and scheduling an event before it panics (time never runs backwards).
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    next_seq: u64,
    max_events: usize,
    now: TimeUs,
}

impl<E> EventQueue<E> {
    /// An empty queue at time 0 that holds at most `max_events` events at once; pushing more
    /// returns [`QueueFull`]. Panics if `max_events` is 0.
    pub fn new(max_events: usize) -> Self {
        assert!(
            max_events > 0,
            "EventQueue::new: max_events must be at least 1"
        );
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
            max_events,
            now: 0,
        }
    }

    /// Schedules `event` at absolute time `time`.
    ///
    /// Panics if `time` is before [`now`](Self::now) (a harness bug).
    pub fn push_at(&mut self, time: TimeUs, event: E) -> Result<(), QueueFull> {
        assert!(
            time >= self.now,
            "event scheduled at {time} us, before the current time {} us",
            self.now
        );
        if self.heap.len() >= self.max_events {
            return Err(QueueFull {
                max_events: self.max_events,
            });
        }
        self.heap.push(Entry {
            time,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
        Ok(())
    }

    /// Schedules `event` at `now + delay_us` (saturating).
    pub fn push_after(&mut self, now: TimeUs, delay_us: u64, event: E) -> Result<(), QueueFull> {
        self.push_at(now.saturating_add(delay_us), event)
    }

    /// Removes the earliest event, advancing [`now`](Self::now) to its time.
    pub fn pop(&mut self) -> Option<(TimeUs, E)> {
        let entry = self.heap.pop()?;
        self.now = entry.time;
        Some((entry.time, entry.event))
    }

    /// Time of the earliest queued event, without removing it.
    pub fn peek_time(&self) -> Option<TimeUs> {
        self.heap.peek().map(|e| e.time)
    }

    /// Time of the last popped event (0 before the first pop).
    pub fn now(&self) -> TimeUs {
        self.now
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    pub fn max_events(&self) -> usize {
        self.max_events
    }
}

struct Entry<E> {
    time: TimeUs,
    seq: u64,
    event: E,
}

// Ordered by (time, seq) only, reversed so that `BinaryHeap` (a max-heap) pops the earliest.
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}
impl<E> Eq for Entry<E> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_by_time_then_insertion_order() {
        let mut q = EventQueue::new(10);
        q.push_at(20, "c").unwrap();
        q.push_at(10, "a").unwrap();
        q.push_at(20, "d").unwrap();
        q.push_after(5, 5, "b").unwrap();
        assert_eq!(q.peek_time(), Some(10));
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(10, "a"), (10, "b"), (20, "c"), (20, "d")]);
        assert_eq!(q.now(), 20);
        assert!(q.is_empty());
    }

    #[test]
    fn limit_refuses_the_event_past_max_events() {
        let mut q = EventQueue::new(2);
        q.push_at(1, 1).unwrap();
        q.push_at(2, 2).unwrap();
        assert_eq!(q.push_at(3, 3), Err(QueueFull { max_events: 2 }));
        assert_eq!(q.len(), 2, "the refused event is not queued");
        q.pop();
        q.push_at(3, 3).unwrap();
        assert!(QueueFull { max_events: 2 }
            .to_string()
            .contains("max_events"));
    }

    #[test]
    #[should_panic(expected = "before the current time")]
    fn scheduling_in_the_past_panics() {
        let mut q = EventQueue::new(4);
        q.push_at(10, ()).unwrap();
        q.pop();
        let _ = q.push_at(9, ());
    }
}
