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

/// Agentic sessions, 64 in flight at a time; each starts from one of 8
/// system prompts (1.5–3 k tokens) and runs 4–12 turns of 100–500 input and
/// 50–300 output tokens, its history resent every turn. Requests are made
/// one at a time (a stored trace of this length would take gigabytes).
#[allow(
    dead_code,
    reason = "only the decision-latency and tier benches use it"
)]
pub(crate) struct Workload {
    rng: Lcg,
    prompts: Vec<Vec<u32>>,
    live: Vec<(Vec<u32>, u32)>,
}

#[allow(
    dead_code,
    reason = "only the decision-latency and tier benches use it"
)]
impl Workload {
    pub(crate) fn new() -> Self {
        let mut rng = Lcg(7);
        let prompts: Vec<Vec<u32>> = (0..8)
            .map(|_| {
                let len = rng.range(1500, 3000);
                rng.tokens(len)
            })
            .collect();
        let mut w = Workload {
            rng,
            prompts,
            live: Vec::new(),
        };
        w.live = (0..64).map(|_| w.new_session()).collect();
        w
    }

    fn new_session(&mut self) -> (Vec<u32>, u32) {
        let p = self.prompts[self.rng.range(0, 8) as usize].clone();
        (p, self.rng.range(4, 13))
    }

    /// The next request: `full[..input_len]` is the input, the rest the
    /// output.
    pub(crate) fn next(&mut self, full: &mut Vec<u32>) -> usize {
        let s = self.rng.range(0, 64) as usize;
        let user = self.rng.range(100, 500);
        let user = self.rng.tokens(user);
        let out = self.rng.range(50, 300);
        let out = self.rng.tokens(out);
        let (hist, left) = &mut self.live[s];
        hist.extend(user);
        let input_len = hist.len();
        hist.extend(out);
        full.clear();
        full.extend_from_slice(hist);
        *left -= 1;
        if *left == 0 {
            self.live[s] = self.new_session();
        }
        input_len
    }
}
