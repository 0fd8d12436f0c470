//! The backup's storage tiers (paper §3.2, Fig 4; spec (c) "Honest tier emulation"), as plain
//! libraries the witness driver calls. No protocol decision is made here.

pub mod io;
pub mod pmem;
pub mod ssdlog;

/// Bytes a structure holds, by tier, for the cost model (DRAM $35.16, NVMM $4.51, SSD $0.32
/// per GB, paper Fig 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Emulated NVMM (shm or dsync files), as provisioned.
    pub nvmm: u64,
    /// SSD log segments, as allocated on disk.
    pub ssd: u64,
    /// DRAM spent on indexes over the other tiers.
    pub dram_index: u64,
}

impl std::ops::Add for TierBytes {
    type Output = TierBytes;
    fn add(self, o: TierBytes) -> TierBytes {
        TierBytes {
            nvmm: self.nvmm + o.nvmm,
            ssd: self.ssd + o.ssd,
            dram_index: self.dram_index + o.dram_index,
        }
    }
}
