//! Chat sessions shared by the tier tests (`tier_shared.rs`, `tier_copies.rs`).

/// Sessions of chat turns over a shared system prompt, interleaved:
/// `(session, input, reply)` per request, each input the session so far
/// plus a new message.
pub(crate) fn sessions(sessions: u32, turns: u32, seed: u32) -> Vec<(usize, Vec<u32>, Vec<u32>)> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let system: Vec<u32> = (0..64).map(|i| 1_000_000 + i).collect();
    let mut hist = vec![system; sessions as usize];
    let mut out = Vec::new();
    for _ in 0..turns {
        for (k, h) in hist.iter_mut().enumerate() {
            let n = 10 + rnd() % 60;
            h.extend((0..n).map(|_| rnd() % 50_000));
            let reply: Vec<u32> = (0..(5 + rnd() % 30)).map(|_| rnd() % 50_000).collect();
            out.push((k, h.clone(), reply.clone()));
            h.extend(reply);
        }
    }
    out
}
