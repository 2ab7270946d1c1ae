//! A fast non-cryptographic hasher for the runtime's and the devices'
//! internal maps, whose keys no user controls.

use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-rotate hasher for small keys that are already well mixed
/// (fingerprints, pointers, indices); SipHash would dominate the cost of a
/// tiny op, and of looking up a recorded trace. It has no random keys, so
/// every process hashes a value alike (the collectives' fingerprints).
/// Values of one length that differ in one word always hash apart: each
/// step is a bijection of the state and of the word.
#[derive(Default)]
pub struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64)
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(v as u64)
    }
    fn finish(&self) -> u64 {
        // A product's high bits mix all of the key, its low bits only the
        // key's low bits; hash tables index by the low bits, and aligned
        // pointers have theirs all zero.
        self.0.rotate_left(26)
    }
}

/// [`FxHasher`] as a map's hasher.
pub type FxBuild = BuildHasherDefault<FxHasher>;
