//! What the benches share: a deterministic generator (no randomness crates
//! in core's benches).

/// A 64-bit linear congruential generator (Knuth's MMIX constants).
pub(crate) struct Lcg(pub(crate) u64);

// Each bench uses its own subset of these: `expect` cannot say that for a
// module compiled into several benches.
#[allow(dead_code, reason = "each bench target uses a different subset")]
impl Lcg {
    /// The next 31-bit value.
    pub(crate) fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    /// A value in `lo..hi`.
    pub(crate) fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + self.next() % (hi - lo)
    }

    /// `n` token ids below 100,000.
    pub(crate) fn tokens(&mut self, n: u32) -> Vec<u32> {
        (0..n).map(|_| self.next() % 100_000).collect()
    }
}
