//! Self-checking record values.
//!
//! A value is a 16-byte header — a fingerprint of its key and a nonce, both little-endian u64 —
//! followed by bytes derived from both. Any value the driver wrote can thus be checked on read
//! without remembering what was written: a value from another key, a torn or corrupted value,
//! or bytes the driver never wrote all fail [`check_value`]. YCSB fills values with random
//! bytes; these are just as incompressible, and cheap to regenerate (one 64-bit mix per 8 bytes).

use crate::keys::fnv_hash64;

/// Bytes of the header every value starts with.
pub const VALUE_HEADER_BYTES: usize = 16;

/// The shortest value: the header and one 8-byte body word. The first body word is a bijection
/// of the nonce (for a given key), so any change to the nonce bytes is caught; with a shorter
/// body a corrupted nonce could pass as another valid value.
pub const MIN_VALUE_BYTES: usize = VALUE_HEADER_BYTES + 8;

/// Why a value read back is not one the driver wrote for its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("value is {len} bytes, shorter than the {MIN_VALUE_BYTES} bytes every value has")]
    TooShort { len: usize },
    #[error("value belongs to another key (fingerprint {found:#x}, expected {expected:#x})")]
    WrongKey { found: u64, expected: u64 },
    #[error("value differs from what was written at byte {offset}")]
    Corrupt { offset: usize },
}

/// A 64-bit fingerprint of a key (FNV-1a over its bytes, then YCSB's 8-byte mix).
pub fn key_fingerprint(key: &[u8]) -> u64 {
    let mut hash: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in key {
        hash ^= b as u64;
        hash = hash.wrapping_mul(1_099_511_628_211);
    }
    fnv_hash64(hash)
}

/// SplitMix64: a bijective mixer, one call per 8 bytes of body.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fill_body(fingerprint: u64, nonce: u64, body: &mut [u8]) {
    let mut state = fingerprint ^ nonce.rotate_left(32);
    for chunk in body.chunks_mut(8) {
        let word = splitmix(&mut state).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// The value of `len_bytes` (at least [`MIN_VALUE_BYTES`]) for `key` under `nonce`.
pub fn make_value(key: &[u8], nonce: u64, len_bytes: usize) -> Vec<u8> {
    assert!(
        len_bytes >= MIN_VALUE_BYTES,
        "values are at least {MIN_VALUE_BYTES} bytes"
    );
    let fingerprint = key_fingerprint(key);
    let mut value = vec![0u8; len_bytes];
    value[..8].copy_from_slice(&fingerprint.to_le_bytes());
    value[8..16].copy_from_slice(&nonce.to_le_bytes());
    fill_body(fingerprint, nonce, &mut value[VALUE_HEADER_BYTES..]);
    value
}

/// Checks that `value` is one [`make_value`] made for `key` (any nonce, any length).
pub fn check_value(key: &[u8], value: &[u8]) -> Result<(), ValueError> {
    if value.len() < MIN_VALUE_BYTES {
        return Err(ValueError::TooShort { len: value.len() });
    }
    let expected = key_fingerprint(key);
    let found = u64::from_le_bytes(value[..8].try_into().expect("8 bytes"));
    if found != expected {
        return Err(ValueError::WrongKey { found, expected });
    }
    let nonce = u64::from_le_bytes(value[8..16].try_into().expect("8 bytes"));
    let mut body = vec![0u8; value.len() - VALUE_HEADER_BYTES];
    fill_body(expected, nonce, &mut body);
    match body
        .iter()
        .zip(&value[VALUE_HEADER_BYTES..])
        .position(|(a, b)| a != b)
    {
        Some(i) => Err(ValueError::Corrupt {
            offset: VALUE_HEADER_BYTES + i,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_single_byte_change_is_caught(
            key in proptest::collection::vec(any::<u8>(), 1..40),
            nonce in any::<u64>(),
            len in MIN_VALUE_BYTES..300usize,
            flip_at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut value = make_value(&key, nonce, len);
            prop_assert_eq!(value.len(), len);
            prop_assert!(check_value(&key, &value).is_ok());
            let i = flip_at.index(len);
            value[i] ^= flip;
            prop_assert!(check_value(&key, &value).is_err());
        }

        #[test]
        fn another_keys_value_is_refused(nonce in any::<u64>(), a in 0u64..1000, b in 0u64..1000) {
            prop_assume!(a != b);
            let (ka, kb) = (format!("user{a}"), format!("user{b}"));
            let value = make_value(ka.as_bytes(), nonce, 64);
            let is_wrong_key = matches!(check_value(kb.as_bytes(), &value), Err(ValueError::WrongKey { .. }));
            prop_assert!(is_wrong_key);
        }
    }

    #[test]
    fn truncated_value_is_refused() {
        let value = make_value(b"user1", 7, 100);
        assert_eq!(
            check_value(b"user1", &value[..10]),
            Err(ValueError::TooShort { len: 10 })
        );
        // A prefix longer than the header is self-consistent: length is the caller's to check.
        assert!(check_value(b"user1", &value[..50]).is_ok());
    }
}
