//! The status a node reports (`ClientReq::Status`): its role and progress, and the bytes it
//! holds per tier (`core::tiers`). Read-only: answering changes nothing, on any node.

use super::*;
use crate::witness::core::tiers;
use crate::witness::proto::StatusReport;

impl WitnessCore {
    /// What this core knows of itself. The NVMM ring and RSS fields are the driver's (zero
    /// here).
    pub fn status_report(&self) -> StatusReport {
        let kind = match self.kind {
            Kind::Head => "head",
            Kind::Backup => "backup",
        };
        let role = match self.role {
            RoleKind::Follower => "follower",
            RoleKind::Candidate => "candidate",
            RoleKind::Provisional => "provisional",
            RoleKind::Leader => "leader",
        };
        let leader = if matches!(self.role, RoleKind::Leader | RoleKind::Provisional) {
            Some(self.id)
        } else {
            self.leader_hint
        };
        let b = &self.backup;
        let keys = if self.kind == Kind::Backup {
            b.index.len()
        } else {
            self.head.keys.len()
        };
        StatusReport {
            id: self.id,
            kind: kind.into(),
            role: role.into(),
            term: self.term,
            leader,
            commit: self.commit,
            last_index: self.log.last_index(),
            serving: self.is_serving(),
            recovering: self.in_recovery(),
            missing_keys: self.missing_keys() as u64,
            keys: keys as u64,
            values: self.head.values.len() as u64,
            written_back_through: b.written_back_through,
            tiers: tiers::core_report(
                &self.head.keys,
                &self.head.values,
                &b.index,
                self.rec.lru.len(),
                self.log_slot_bytes(),
                b.space.used_bytes(),
            ),
            rss_bytes: 0,
            rss_shared_bytes: 0,
        }
    }

    pub(super) fn on_status(&mut self, tag: u64) {
        let reply = ClientReply::Status(Box::new(self.status_report()));
        self.out.push(Output::Reply { tag, reply });
    }

    /// The Raft log's slot array at its capacity. The slots' own heap (a key per entry, a value
    /// until it is applied or written back) is not counted: it is bounded by the NVMM ring
    /// (the same entries, reported as `nvmm_buffer_used_bytes`) and by `log_keep_entries`.
    fn log_slot_bytes(&self) -> u64 {
        tiers::alloc_bytes(self.log.slots.capacity() * std::mem::size_of::<Slot>())
    }

    /// The tier counters equal a recount (run from `check_invariants_deep`).
    pub(super) fn check_tiers_deep(&self) {
        let h = &self.head;
        for (name, counted, recounted) in [
            (
                "key table",
                (h.keys.heap_bytes(), h.keys.ssd_bytes()),
                h.keys.recount(),
            ),
            (
                "value table",
                (h.values.heap_bytes(), h.values.ssd_bytes()),
                h.values.recount(),
            ),
            (
                "backup index",
                (
                    self.backup.index.heap_bytes(),
                    self.backup.index.ssd_bytes(),
                ),
                self.backup.index.recount(),
            ),
        ] {
            assert_eq!(
                counted, recounted,
                "{name}: counted (heap, SSD) bytes drifted"
            );
        }
    }
}
