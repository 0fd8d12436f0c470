//! Record keys: YCSB's `user<number>` names, in hashed or ordered insert order, of variable or
//! fixed length.

use crate::ConfigError;

const FNV_OFFSET_BASIS_64: u64 = 0xCBF2_9CE4_8422_2325;
const FNV_PRIME_64: u64 = 1_099_511_628_211;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the 8 little-endian bytes of `value`, then the absolute
/// value as a Java `long`. YCSB scrambles key numbers (hashed insert order) and zipfian ranks
/// (scrambled zipfian) with it; we keep it bit for bit so keys match YCSB's.
pub fn fnv_hash64(mut value: u64) -> u64 {
    let mut hash = FNV_OFFSET_BASIS_64;
    for _ in 0..8 {
        hash ^= value & 0xff;
        hash = hash.wrapping_mul(FNV_PRIME_64);
        value >>= 8;
    }
    // Java's Math.abs(Long.MIN_VALUE) stays negative; as an unsigned number that is 2^63.
    (hash as i64).wrapping_abs() as u64
}

/// In which order the load phase's key numbers map to keys (YCSB's `insertorder`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsertOrder {
    /// Key numbers are hashed, so consecutive inserts scatter over the key space (YCSB default).
    Hashed,
    /// `user0`, `user1`, ...: inserts append at the end of the key space.
    Ordered,
}

/// How a key number becomes a key.
///
/// Without a fixed size the key is exactly YCSB's: the prefix followed by the decimal number
/// (hashed with [`fnv_hash64`] in hashed order). With `key_size_bytes = n` the number is
/// zero-padded to `n - prefix.len()` digits. Where fewer than 19 digits fit, hashed order uses
/// an affine bijection modulo `10^digits` instead of FNV, so that distinct key numbers never
/// collide on one key (a truncated hash would: 1 M keys in 12 digits collide with odds near
/// one half).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFormat {
    pub prefix: String,
    pub order: InsertOrder,
    pub key_size_bytes: Option<usize>,
}

/// Digits a u64 needs at most.
const U64_DIGITS: usize = 20;
/// FNV values are below 2^63 < 10^19, so 19 digits hold any of them.
const FNV_DIGITS: usize = 19;
/// Multiplier of the affine bijection: odd and not a multiple of 5, so it is coprime with every
/// power of ten and hence invertible modulo it.
const AFFINE_MULTIPLIER: u128 = 2_862_933_555_777_941_757;
const AFFINE_OFFSET: u128 = 1_442_695_040_888_963_407;

impl Default for KeyFormat {
    fn default() -> Self {
        KeyFormat {
            prefix: "user".to_string(),
            order: InsertOrder::Hashed,
            key_size_bytes: None,
        }
    }
}

impl KeyFormat {
    /// Checks the format; a fixed size must leave at least one digit after the prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(size) = self.key_size_bytes {
            if size <= self.prefix.len() || size - self.prefix.len() > U64_DIGITS {
                return Err(ConfigError::new(format!(
                    "key size {size} bytes: must be between {} and {} for the prefix {:?} \
                     (one to {U64_DIGITS} digits after it)",
                    self.prefix.len() + 1,
                    self.prefix.len() + U64_DIGITS,
                    self.prefix
                )));
            }
        }
        Ok(())
    }

    fn digits(&self) -> Option<usize> {
        self.key_size_bytes.map(|size| size - self.prefix.len())
    }

    /// How many distinct key numbers this format can name (`u64::MAX` when unbounded).
    pub fn capacity(&self) -> u64 {
        match self.digits() {
            Some(d) if d < U64_DIGITS => 10u64.pow(d as u32),
            _ => u64::MAX,
        }
    }

    /// The key of key number `keynum`. Panics if `keynum >= self.capacity()` (the runner checks
    /// before it inserts).
    pub fn key(&self, keynum: u64) -> Vec<u8> {
        assert!(
            keynum < self.capacity(),
            "key number {keynum} exceeds the key format's capacity {}",
            self.capacity()
        );
        let number = match (self.order, self.digits()) {
            (InsertOrder::Ordered, _) => keynum,
            (InsertOrder::Hashed, None) => fnv_hash64(keynum),
            (InsertOrder::Hashed, Some(d)) if d >= FNV_DIGITS => fnv_hash64(keynum),
            (InsertOrder::Hashed, Some(d)) => {
                let modulus = 10u128.pow(d as u32);
                ((AFFINE_MULTIPLIER % modulus) * keynum as u128 + AFFINE_OFFSET % modulus)
                    .rem_euclid(modulus) as u64
            }
        };
        let text = match self.digits() {
            Some(d) => format!("{}{number:0d$}", self.prefix),
            None => format!("{}{number}", self.prefix),
        };
        text.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn matches_ycsb_fnv() {
        // FNV-1a of eight zero bytes, computed independently: each step multiplies by the prime.
        let mut h: u64 = 0xCBF2_9CE4_8422_2325;
        for _ in 0..8 {
            h = h.wrapping_mul(1_099_511_628_211);
        }
        assert_eq!(fnv_hash64(0), (h as i64).unsigned_abs());
        let ycsb = KeyFormat::default();
        assert_eq!(ycsb.key(0), format!("user{}", fnv_hash64(0)).into_bytes());
        let ordered = KeyFormat {
            order: InsertOrder::Ordered,
            ..KeyFormat::default()
        };
        assert_eq!(ordered.key(42), b"user42".to_vec());
    }

    #[test]
    fn fixed_size_keys_are_distinct_and_sized() {
        for size in [5, 8, 16, 23, 24] {
            let format = KeyFormat {
                key_size_bytes: Some(size),
                ..KeyFormat::default()
            };
            format.validate().unwrap();
            let n = format.capacity().min(20_000);
            let keys: HashSet<Vec<u8>> = (0..n).map(|k| format.key(k)).collect();
            assert_eq!(keys.len() as u64, n, "size {size}");
            assert!(keys.iter().all(|k| k.len() == size), "size {size}");
        }
        let short = KeyFormat {
            key_size_bytes: Some(4),
            ..KeyFormat::default()
        };
        assert!(short.validate().is_err());
    }

    #[test]
    fn affine_scramble_is_a_bijection_on_small_spaces() {
        let format = KeyFormat {
            key_size_bytes: Some(7), // 1000 keys
            ..KeyFormat::default()
        };
        let keys: HashSet<Vec<u8>> = (0..1000).map(|k| format.key(k)).collect();
        assert_eq!(keys.len(), 1000);
        // Consecutive key numbers do not land next to each other.
        assert_ne!(format.key(1), b"user001".to_vec());
    }
}
