//! What the event stream (docs/events.md) costs an engine: a synthetic
//! trace served request by request with `CacheConfig::events` off and on,
//! and on, every request's changes drained and encoded into a vLLM
//! `KVEventBatch` (`marconi-events`' encoder: chained SHA-256 block hashes,
//! msgpack). Prints per-request p50 / p99 / max of the request itself
//! (events off and on) and of drain + encode, in CPU time of the thread
//! (a busy machine's other processes do not count), and the events and
//! bytes produced. Not a criterion bench: it prints figures.
//!
//! ```text
//! cargo bench -p marconi-sim --bench events
//! cargo bench -p marconi-sim --bench events -- --workload chat --sessions 200 --page 16
//! ```
#![expect(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    reason = "figures"
)]

use marconi_core::{AlphaMode, CacheConfig, ModelSpec, PrefixCache};
use marconi_events::{Encoder, EncoderConfig};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};

/// CPU time of this thread in µs: what an operation costs, without the
/// time other processes on a busy machine take from it.
fn cpu_us() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: t is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    t.tv_sec as f64 * 1e6 + t.tv_nsec as f64 / 1e3
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let mut kind = SynthKind::Agentic;
    let mut sessions = 60u32;
    let mut page = 16u32;
    let mut capacity = 10_000_000_000u64;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--workload" => {
                kind = match v.as_str() {
                    "agentic" => SynthKind::Agentic,
                    "chat" => SynthKind::Chat,
                    "longout" => SynthKind::Longout,
                    o => panic!("--workload {o}: agentic, chat or longout"),
                };
            }
            "--sessions" => sessions = v.parse().expect("--sessions N"),
            "--page" => page = v.parse().expect("--page N"),
            "--capacity-gb" => {
                capacity = (v.parse::<f64>().expect("--capacity-gb X") * 1e9) as u64;
            }
            "--bench" => {
                i += 1;
                continue;
            }
            _ => {}
        }
        i += 2;
    }
    {
        // The cost of one block digest (SHA-256 of its CBOR), for scale.
        let h = marconi_events::BlockHasher::default();
        let block: Vec<u32> = (0..page).map(|i| i * 7919 + 100_000).collect();
        let mut d = h.hash_block(None, &block, 0);
        let t = cpu_us();
        for _ in 0..20_000 {
            d = h.hash_block(Some(&d), &block, 0);
        }
        println!(
            "one block digest ({page} tokens): {:.2} µs",
            (cpu_us() - t) / 20_000.0
        );
    }
    {
        // One large admission: 40,000 new tokens after a 5,000-token prefix
        // the encoder has seen stored.
        let toks: Vec<u32> = (0..45_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let prefix: std::sync::Arc<[u32]> = toks.into();
        let stored = |start: u32, end: u32| marconi_core::CacheEvent::KvStored {
            ns: 0,
            start,
            end,
            prefix: prefix.clone(),
        };
        let mut best = f64::MAX;
        for _ in 0..5 {
            let mut enc = Encoder::new(EncoderConfig::new(page)).expect("a valid encoder");
            enc.translate(&[stored(0, 4992)]);
            let t = cpu_us();
            let n = enc.translate(&[stored(4992, 44_992)]).len();
            best = best.min(cpu_us() - t);
            assert_eq!(n, 1);
        }
        println!("one KvStored of 40,000 new tokens after 4,992 cached: {best:.0} µs (best of 5)");
    }
    let mut sc = SynthConfig::new(kind);
    sc.sessions = sessions;
    let trace = generate(&sc);
    let model = ModelSpec::preset("paper-7b").expect("a preset");
    let run = |events: bool| {
        let mut cfg = CacheConfig::marconi(model.clone(), capacity);
        cfg.page_size = page;
        cfg.alpha = AlphaMode::Fixed(1.0); // no tuning replays in the figures
        cfg.events = events;
        let mut cache = PrefixCache::new(cfg).expect("a valid config");
        let mut enc = Encoder::new(EncoderConfig::new(page)).expect("a valid encoder");
        let (mut req, mut drain) = (Vec::new(), Vec::new());
        let (mut n_events, mut bytes, mut evictions) = (0usize, 0usize, 0u64);
        trace.for_each(|r| {
            let t = cpu_us();
            cache.serve_full(0, r.input_len, r.full).expect("served");
            req.push(cpu_us() - t);
            if events {
                let t = cpu_us();
                let evs = cache.drain_events();
                let payload = enc.encode(1.0, &evs);
                let us = cpu_us() - t;
                drain.push(us);
                n_events += evs.len();
                bytes += payload.len();
            }
        });
        evictions += cache.stats().evictions;
        if events {
            let (hashed, cold) = enc.hash_counts();
            println!(
                "encoder: {hashed} blocks hashed with SHA-256, {cold} chains hashed from block 0, {} block digests remembered",
                enc.remembered_blocks()
            );
        }
        (req, drain, n_events, bytes, evictions)
    };
    let (mut off, _, _, _, ev_off) = run(false);
    let (mut on, mut drain, n_events, bytes, ev_on) = run(true);
    assert_eq!(ev_off, ev_on, "events must not change a decision");
    let n = trace.len();
    println!(
        "{n} requests ({kind:?}, {sessions} sessions), page {page}, capacity {:.1} GB, {ev_on} evictions",
        capacity as f64 / 1e9
    );
    println!(
        "{:<34} {:>9} {:>9} {:>10}",
        "per request (µs of CPU)", "p50", "p99", "max"
    );
    for (name, v) in [
        ("request, events off", &mut off),
        ("request, events on", &mut on),
        ("drain + encode (events on)", &mut drain),
    ] {
        let max = v.iter().copied().fold(0.0, f64::max);
        println!(
            "{name:<34} {:>9.1} {:>9.1} {:>10.1}",
            pct(v, 0.5),
            pct(v, 0.99),
            max
        );
    }
    println!(
        "{n_events} core events, {:.1} per request; {:.1} MB of msgpack, {:.0} B per request",
        n_events as f64 / n as f64,
        bytes as f64 / 1e6,
        bytes as f64 / n as f64
    );
}
