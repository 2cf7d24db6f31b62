//! A seeded fuzzer of the model readers and of memory planning, through the
//! C ABI.
//!
//! ```text
//! cargo run --release -p marconi-ffi --example fuzz_readers -- --seed 0 --seeds 8 --calls 5000
//! cargo run --release -p marconi-ffi --example fuzz_readers -- --seeds 1000000 --seconds 1800
//! ```
//!
//! What it feeds: GGUF files of every architecture `marconi_model_spec_from_gguf`
//! maps and Hugging Face configs of every family
//! `marconi_model_spec_from_hf_config` reads, each starting from a valid
//! one and mutated (a numeric field set to 0, 1, a huge value or a negative
//! one, two fields swapped, a field removed, retyped or duplicated, the
//! architecture switched, per-layer lists lengthened or cut, then sometimes
//! the bytes truncated or flipped), as bytes and as files; paths that are
//! not regular files (a FIFO with no writer, a FIFO with a writer that
//! never closes, a directory, `/dev/zero`, `/dev/null`, a symlink to a
//! FIFO, a missing file); and `marconi_plan` with random and extreme page
//! sizes, budgets, state fractions, contexts and batches, for presets and
//! for the specs the readers accepted.
//!
//! What it checks: no call returns MARCONI_STATUS_PANIC or an unexpected
//! status; no call takes longer than `--call-timeout` seconds (a watchdog
//! reports the hang and exits 3: a blocked thread cannot be stopped); a GGUF
//! whose metadata parses is never refused with INVALID_ARGUMENT (a model
//! that cannot drive a cache is INVALID_CONFIG); an accepted spec passes
//! `ModelSpec::validate`, has no more KV heads than query heads, at least
//! one expert a token where it has MoE layers, and came from a file whose
//! convolution width, Mamba-2 group count and experts a token were possible;
//! it builds a cache that serves a request. A plan that succeeds has a
//! state fraction in (0, 1], and its batches and contexts are the largest
//! that fit (0 when not one sequence fits), recomputed here in 128-bit
//! arithmetic.
//!
//! A finding prints its seed and call index (`--seed S --seeds 1 --calls N`
//! replays it: a run is deterministic). `--only gguf,hf,path,plan` picks
//! the kinds of round (the draws stay the same). Exits 1 when anything was
//! found, 3 on a hang.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::mem::{size_of, MaybeUninit};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use marconi::cache::*;
use marconi::config::*;
use marconi::gguf::{marconi_model_spec_from_gguf, marconi_model_spec_from_gguf_bytes};
use marconi::hf_config::marconi_model_spec_from_hf_config;
use marconi::plan::*;
use marconi::status::marconi_status as St;
use serde_json::Value;

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "fuzz_abi_parts/rng.rs"]
mod rng;

use common::{last_error, versioned};
use rng::Rng;

// ---------------------------------------------------------------- rng ----

/// This fuzzer's stream of the shared SplitMix64 (see rng.rs).
const RNG_SALT: u64 = 0x2545_f491_4f6c_dd1d;

// ----------------------------------------------------------- watchdog ----

/// The call in flight: its start (ms since the run began, + 1; 0 when
/// idle) and what it is.
struct Watch {
    start_ms: AtomicU64,
    what: Mutex<String>,
    began: Instant,
}

impl Watch {
    fn enter(&self, what: String) {
        *self.what.lock().unwrap_or_else(|e| e.into_inner()) = what;
        let now = self.began.elapsed().as_millis() as u64 + 1;
        self.start_ms.store(now, Ordering::SeqCst);
    }
    fn leave(&self) {
        self.start_ms.store(0, Ordering::SeqCst);
    }
}

fn spawn_watchdog(watch: Arc<Watch>, limit: Duration) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50));
        let start = watch.start_ms.load(Ordering::SeqCst);
        if start == 0 {
            continue;
        }
        let now = watch.began.elapsed().as_millis() as u64 + 1;
        if now.saturating_sub(start) > limit.as_millis() as u64 {
            let what = watch.what.lock().unwrap_or_else(|e| e.into_inner()).clone();
            println!(
                "FINDING hang: {what} has not returned after {:.1} s",
                limit.as_secs_f64()
            );
            std::process::exit(3);
        }
    });
}

// ------------------------------------------------------------- GGUF ----

/// A GGUF metadata value the seeds and mutations use.
#[derive(Clone, Debug)]
enum V {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    I32s(Vec<i32>),
}

/// GGUF metadata as an ordered list of keys (duplicates allowed: a
/// mutation may add one).
type Gguf = Vec<(String, V)>;

fn encode_gguf(kvs: &Gguf) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend_from_slice(&(x.len() as u64).to_le_bytes());
        b.extend_from_slice(x.as_bytes());
    };
    for (k, v) in kvs {
        s(&mut b, k);
        match v {
            V::U32(x) => {
                b.extend_from_slice(&4u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
            V::I32(x) => {
                b.extend_from_slice(&5u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
            V::F32(x) => {
                b.extend_from_slice(&6u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
            V::Bool(x) => {
                b.extend_from_slice(&7u32.to_le_bytes());
                b.push(u8::from(*x));
            }
            V::Str(x) => {
                b.extend_from_slice(&8u32.to_le_bytes());
                s(&mut b, x);
            }
            V::I32s(xs) => {
                b.extend_from_slice(&9u32.to_le_bytes());
                b.extend_from_slice(&5u32.to_le_bytes());
                b.extend_from_slice(&(xs.len() as u64).to_le_bytes());
                for x in xs {
                    b.extend_from_slice(&x.to_le_bytes());
                }
            }
            V::U64(x) => {
                b.extend_from_slice(&10u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    b
}

/// A valid GGUF of each architecture the reader maps.
fn gguf_seeds() -> Vec<Gguf> {
    let kv = |arch: &str, keys: &[(&str, V)]| -> Gguf {
        let mut g = vec![("general.architecture".to_owned(), V::Str(arch.into()))];
        g.extend(keys.iter().map(|(k, v)| (format!("{arch}.{k}"), v.clone())));
        g
    };
    let ssm = |groups: bool| {
        let mut v = vec![
            ("ssm.conv_kernel", V::U32(4)),
            ("ssm.inner_size", V::U32(256)),
            ("ssm.state_size", V::U32(16)),
            ("ssm.time_step_rank", V::U32(8)),
        ];
        if groups {
            v.push(("ssm.group_count", V::U32(2)));
        }
        v
    };
    // The keys of every family with attention layers: blocks, width,
    // heads, KV heads and FFN width (per-layer arrays where layers differ).
    let attention = |blocks: u32, width: u32, heads: V, kv_heads: V, ffn: V| {
        vec![
            ("block_count", V::U32(blocks)),
            ("embedding_length", V::U32(width)),
            ("attention.head_count", heads),
            ("attention.head_count_kv", kv_heads),
            ("feed_forward_length", ffn),
        ]
    };
    let experts = |count: u32, used: u32| {
        [
            ("expert_count", V::U32(count)),
            ("expert_used_count", V::U32(used)),
        ]
    };
    let nemotron = |arch: &str, moe: bool| {
        let per_layer = |v: [i32; 6]| V::I32s(v.to_vec());
        let mut keys = attention(
            6,
            128,
            per_layer([0, 4, 0, 0, 0, 0]),
            per_layer([0, 2, 0, 0, 0, 0]),
            per_layer([0, 0, 256, 0, 256, 0]),
        );
        keys.extend(ssm(true));
        if moe {
            keys.extend(experts(8, 2));
        }
        kv(arch, &keys)
    };
    let dense = |arch: &str| {
        let mut keys = attention(2, 64, V::U32(4), V::U32(2), V::U32(128));
        keys.push(("attention.key_length", V::U32(16)));
        kv(arch, &keys)
    };
    let kv_heads = V::I32s(vec![0, 2, 0, 0]);
    let mut granite = attention(4, 128, V::U32(4), kv_heads, V::U32(256));
    granite.extend(experts(4, 2));
    granite.extend(ssm(true));
    let mut falcon = attention(3, 128, V::U32(4), V::U32(2), V::U32(256));
    falcon.push(("attention.key_length", V::U32(32)));
    falcon.push(("attention.value_length", V::U32(32)));
    falcon.extend(ssm(true));
    // Pure SSM: two blocks, the SSM keys (Mamba2's with groups).
    let mamba = |groups: bool| {
        let mut keys = vec![
            ("block_count", V::U32(2)),
            ("embedding_length", V::U32(128)),
        ];
        keys.extend(ssm(groups));
        keys
    };
    let mut out = vec![
        nemotron("nemotron_h", false),
        nemotron("nemotron_h_moe", true),
        kv("granitehybrid", &granite),
        kv("falcon-h1", &falcon),
        kv("mamba2", &mamba(true)),
        kv("mamba", &mamba(false)),
        dense("llama"),
        dense("qwen2"),
        dense("qwen3"),
    ];
    for g in &mut out {
        g.push(("general.name".into(), V::Str("fuzz".into())));
        g.push((
            "tokenizer.ggml.tokens".into(),
            V::I32s(vec![1, 2, 3]), // an array the reader keeps or skips
        ));
    }
    out
}

const HUGE_U32: [u32; 8] = [0, 1, 2, 3, 1 << 16, (1 << 16) + 1, u32::MAX - 1, u32::MAX];
const ODD_I32: [i32; 7] = [0, -1, 1, i32::MIN, i32::MAX, 65_536, -65_536];

fn mutate_gguf(rng: &mut Rng, mut g: Gguf) -> Gguf {
    for _ in 0..1 + rng.below(3) {
        if g.is_empty() {
            break;
        }
        let i = rng.index(g.len());
        match rng.below(9) {
            0..=2 => {
                // A numeric value to an extreme.
                let v = &mut g[i].1;
                *v = match v {
                    V::I32s(xs) if !xs.is_empty() => {
                        let mut xs = xs.clone();
                        if rng.chance(1, 2) {
                            let j = rng.index(xs.len());
                            xs[j] = rng.pick(&ODD_I32);
                        } else {
                            let x = rng.pick(&ODD_I32);
                            xs.iter_mut().for_each(|e| *e = x);
                        }
                        V::I32s(xs)
                    }
                    _ if rng.chance(1, 4) => V::U32(rng.next() as u32),
                    _ => V::U32(rng.pick(&HUGE_U32)),
                };
            }
            3 => {
                let j = rng.index(g.len());
                let (a, b) = (g[i].1.clone(), g[j].1.clone());
                g[i].1 = b;
                g[j].1 = a;
            }
            4 => {
                g.remove(i);
            }
            5 => {
                // Retyped.
                g[i].1 = match rng.below(6) {
                    0 => {
                        let x = rng.next();
                        V::U64(rng.pick(&[0, u64::MAX, 1 << 40, x]))
                    }
                    1 => V::I32(rng.pick(&ODD_I32)),
                    2 => V::F32(rng.pick(&[0.0, -1.0, f32::NAN, f32::INFINITY, 4.0])),
                    3 => V::Bool(rng.chance(1, 2)),
                    4 => V::Str(rng.pick(&["", "4", "nemotron_h", "\u{0}"]).into()),
                    _ => V::I32s((0..rng.below(9)).map(|_| rng.pick(&ODD_I32)).collect()),
                };
            }
            6 => {
                // A duplicate key with another value.
                let k = g[i].0.clone();
                g.push((k, V::U32(rng.pick(&HUGE_U32))));
            }
            7 => {
                // Another architecture's name over these keys.
                let arch = rng.pick(marconi_core::GGUF_ARCHITECTURES);
                if let Some(e) = g.iter_mut().find(|(k, _)| k == "general.architecture") {
                    e.1 = V::Str(arch.into());
                }
            }
            _ => {
                // A per-layer list lengthened or cut.
                if let V::I32s(xs) = &mut g[i].1 {
                    if rng.chance(1, 2) || xs.is_empty() {
                        xs.push(rng.pick(&ODD_I32));
                    } else {
                        xs.pop();
                    }
                }
            }
        }
    }
    g
}

fn mutate_bytes(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    match rng.below(4) {
        0 => {
            let cut = rng.index(b.len() + 1);
            b.truncate(cut);
        }
        1 => {
            for _ in 0..1 + rng.below(8) {
                if !b.is_empty() {
                    let i = rng.index(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
            }
        }
        2 => {
            // A length or count field set to something huge.
            if b.len() >= 24 {
                let any = rng.index(b.len() - 7);
                let at = rng.pick(&[16usize, 24.min(b.len() - 8), any]);
                let x = rng.pick(&[u64::MAX, 1 << 40, 0, u64::from(u32::MAX)]);
                b[at..at + 8].copy_from_slice(&x.to_le_bytes());
            }
        }
        _ => {
            let at = rng.index(b.len() + 1);
            let n = rng.below(16) as usize;
            let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            b.splice(at..at, junk);
        }
    }
    b
}

fn gguf_u64(g: &Gguf, key: &str) -> Option<u64> {
    // The reader takes the first value of a repeated key.
    g.iter().find(|(k, _)| k == key).and_then(|(_, v)| match v {
        V::U32(x) => Some(u64::from(*x)),
        V::U64(x) => Some(*x),
        V::I32(x) => u64::try_from(*x).ok(),
        _ => None,
    })
}

// --------------------------------------------------------- HF config ----

const HF_SEEDS: &[&str] = &[
    r#"{"model_type": "nemotron_h", "hidden_size": 64, "hybrid_override_pattern": "M-M*-",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "mlp_hidden_act": "relu2", "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "torch_dtype": "float32"}"#,
    r#"{"model_type": "nemotron_h", "hidden_size": 64, "hybrid_override_pattern": "ME*EM",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts_per_tok": 2, "n_routed_experts": 8, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "torch_dtype": "bfloat16"}"#,
    r#"{"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "shared_intermediate_size": 96,
        "num_local_experts": 8, "num_experts_per_tok": 2,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}"#,
    r#"{"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
        "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_d_ssm": null, "dtype": "float16"}"#,
    r#"{"model_type": "zamba2", "hidden_size": 64, "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 256, "n_mamba_heads": 8, "mamba_headdim": 16,
        "mamba_d_state": 16, "mamba_ngroups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "torch_dtype": "float32"}"#,
    r#"{"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 8,
        "attn_layer_period": 4, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 16, "num_experts_per_tok": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "torch_dtype": "bfloat16"}"#,
    r#"{"model_type": "bamba", "hidden_size": 64, "num_hidden_layers": 4,
        "attn_layer_indices": [1, 3], "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
        "torch_dtype": "bfloat16"}"#,
    r#"{"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2,
        "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1,
        "conv_kernel": 4, "expand": 2}"#,
    r#"{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "state_size": 16, "conv_kernel": 4}"#,
];

const CONV_KEYS: &[&str] = &["conv_kernel", "mamba_d_conv"];
const GROUP_KEYS: &[&str] = &["n_groups", "mamba_n_groups", "mamba_ngroups"];
const EXPERT_COUNT_KEYS: &[&str] = &["n_routed_experts", "num_local_experts", "num_experts"];

fn mutate_hf(rng: &mut Rng, mut v: Value) -> Value {
    let Some(obj) = v.as_object_mut() else {
        return v;
    };
    for _ in 0..1 + rng.below(3) {
        let keys: Vec<String> = obj.keys().cloned().collect();
        if keys.is_empty() {
            break;
        }
        let k = rng.pick(&keys);
        match rng.below(8) {
            0..=2 => {
                let x: Value = match rng.below(9) {
                    0 => 0.into(),
                    1 => 1.into(),
                    2 => (-1).into(),
                    3 => u32::MAX.into(),
                    4 => u64::MAX.into(),
                    5 => 1e30.into(),
                    6 => (1u64 << 53).into(),
                    7 => 2.5.into(),
                    _ => rng.next().into(),
                };
                obj.insert(k, x);
            }
            3 => {
                let k2 = rng.pick(&keys);
                let (a, b) = (obj[&k].clone(), obj[&k2].clone());
                obj.insert(k, b);
                obj.insert(k2, a);
            }
            4 => {
                obj.remove(&k);
            }
            5 => {
                let x: Value = match rng.below(4) {
                    0 => Value::Null,
                    1 => "4".into(),
                    2 => Value::Array(vec![]),
                    _ => true.into(),
                };
                obj.insert(k, x);
            }
            6 => {
                let fam = rng.pick(marconi_core::HF_MODEL_TYPES);
                obj.insert("model_type".into(), fam.into());
            }
            _ => {
                // A layer pattern or list edited.
                match obj.get_mut(&k) {
                    Some(Value::String(s)) => {
                        let mut c: Vec<char> = s.chars().collect();
                        match rng.below(3) {
                            0 if !c.is_empty() => {
                                let i = rng.index(c.len());
                                c[i] = rng.pick(&['M', '*', '-', 'E', 'X']);
                            }
                            1 => {
                                let n = rng.index(c.len() + 1);
                                c.truncate(n);
                            }
                            _ => c.extend(c.clone()),
                        }
                        *s = c.into_iter().collect();
                    }
                    Some(Value::Array(a)) => {
                        if rng.chance(1, 2) || a.is_empty() {
                            a.push(rng.pick(&["mamba", "attention", "hybrid", "x"]).into());
                        } else {
                            a.pop();
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    v
}

// ------------------------------------------------------------ checks ----

struct Fuzz {
    seed: u64,
    call: u64,
    calls: u64,
    findings: u64,
    watch: Arc<Watch>,
    dir: PathBuf,
    /// Specs the readers accepted, for the plans.
    accepted: Vec<marconi_model_spec>,
}

impl Fuzz {
    fn finding(&mut self, what: &str) {
        self.findings += 1;
        if self.findings <= 30 {
            println!("FINDING seed {} call {}: {what}", self.seed, self.call);
        }
    }

    /// Runs `f` under the watchdog.
    fn call<T>(&mut self, what: &str, f: impl FnOnce() -> T) -> T {
        self.calls += 1;
        self.watch
            .enter(format!("seed {} call {}: {what}", self.seed, self.call));
        let r = f();
        self.watch.leave();
        r
    }

    fn status_is(&mut self, what: &str, st: St, allowed: &[St]) -> bool {
        if st == St::Panic {
            self.finding(&format!("{what}: PANIC: {}", last_error()));
            return false;
        }
        if !allowed.contains(&st) {
            self.finding(&format!("{what}: unexpected {st:?}: {}", last_error()));
            return false;
        }
        true
    }

    /// What every accepted spec must satisfy, and that it drives a cache.
    fn check_spec(&mut self, what: &str, m: &marconi_model_spec) {
        let core = m.to_core("fuzz");
        if let Err(e) = core.validate() {
            self.finding(&format!(
                "{what}: accepted a spec that fails validation: {e}"
            ));
            return;
        }
        if m.attn_layers > 0 && m.kv_heads > m.n_heads {
            self.finding(&format!(
                "{what}: accepted {} KV heads for {} query heads",
                m.kv_heads, m.n_heads
            ));
        }
        if m.moe_layers > 0 && m.moe_top_k == 0 {
            self.finding(&format!(
                "{what}: accepted MoE layers with 0 experts a token"
            ));
        }
        let mut cfg = MaybeUninit::<marconi_cache_config>::uninit();
        // SAFETY: cfg has sizeof(marconi_cache_config) writable bytes.
        let st = unsafe {
            marconi_cache_config_init(cfg.as_mut_ptr(), size_of::<marconi_cache_config>())
        };
        assert_eq!(st, St::Ok);
        // SAFETY: initialised above.
        let mut cfg = unsafe { cfg.assume_init() };
        cfg.model_preset = ptr::null();
        cfg.model = *m;
        cfg.page_size = 16;
        cfg.capacity_bytes = u64::MAX / 4;
        let mut cache = ptr::null_mut();
        // SAFETY: a valid config and out pointer.
        let st = self.call("marconi_cache_new", || unsafe {
            marconi_cache_new(&cfg, &mut cache)
        });
        if st != St::Ok {
            self.finding(&format!(
                "{what}: an accepted spec builds no cache: {st:?} {}",
                last_error()
            ));
            return;
        }
        let tokens: Vec<u32> = (0..40).collect();
        let mut l = marconi_lookup::default();
        let s = [marconi_saved_state {
            position: 32,
            slot: 7,
        }];
        let mut out = marconi_admit_result::default();
        // SAFETY: a live handle and valid buffers; the handle is freed once.
        let sts = self.call("a request on the accepted spec", || unsafe {
            let a = marconi_cache_lookup(cache, 0, tokens.as_ptr(), 20, MARCONI_NO_SLOT, &mut l);
            let b = marconi_cache_admit(
                cache,
                l.lease,
                tokens.as_ptr(),
                tokens.len(),
                s.as_ptr(),
                1,
                ptr::null(),
                0,
                ptr::null_mut(),
                &mut out,
            );
            let c = marconi_cache_release(cache, l.lease);
            marconi_cache_free(cache);
            [a, b, c]
        });
        if sts != [St::Ok; 3] {
            self.finding(&format!("{what}: a request on an accepted spec: {sts:?}"));
        }
        if self.accepted.len() < 64 {
            self.accepted.push(*m);
        }
    }

    fn gguf_round(&mut self, rng: &mut Rng, seeds: &[Gguf]) {
        let base = rng.pick(seeds);
        let g = if rng.chance(7, 8) {
            mutate_gguf(rng, base)
        } else {
            base
        };
        let mut bytes = encode_gguf(&g);
        let byte_level = rng.chance(1, 4);
        if byte_level {
            bytes = mutate_bytes(rng, bytes);
        }
        let mut out = marconi_model_spec::default();
        let (what, st) = if rng.chance(1, 4) {
            let path = self.dir.join("m.gguf");
            if std::fs::write(&path, &bytes).is_err() {
                return;
            }
            let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
            // SAFETY: a NUL-terminated path and a writable out.
            let st = self.call("marconi_model_spec_from_gguf", || unsafe {
                marconi_model_spec_from_gguf(c.as_ptr(), &mut out)
            });
            ("gguf file", st)
        } else {
            // SAFETY: bytes has its length readable; out is writable.
            let st = self.call("marconi_model_spec_from_gguf_bytes", || unsafe {
                marconi_model_spec_from_gguf_bytes(bytes.as_ptr(), bytes.len(), &mut out)
            });
            ("gguf bytes", st)
        };
        if !self.status_is(what, st, &[St::Ok, St::InvalidArgument, St::InvalidConfig]) {
            return;
        }
        let parses = marconi_core::gguf::parse_metadata(&bytes).is_ok();
        if st == St::InvalidArgument && parses {
            self.finding(&format!(
                "{what}: well-formed GGUF refused as INVALID_ARGUMENT (the header says INVALID_CONFIG): {}",
                last_error()
            ));
        }
        if st != St::Ok {
            return;
        }
        if !byte_level {
            // What the spec no longer holds, read back from the input.
            let arch = match g.iter().find(|(k, _)| k == "general.architecture") {
                Some((_, V::Str(a))) => a.clone(),
                _ => String::new(),
            };
            let key = |k: &str| gguf_u64(&g, &format!("{arch}.{k}"));
            if out.ssm_layers > 0 {
                if key("ssm.conv_kernel") == Some(0) {
                    self.finding("gguf: accepted ssm.conv_kernel 0");
                }
                if arch != "mamba" && key("ssm.group_count").unwrap_or(0) == 0 {
                    self.finding("gguf: accepted a Mamba-2 mixer with 0 groups");
                }
            }
            if let (Some(used), Some(count)) = (key("expert_used_count"), key("expert_count")) {
                if used > count {
                    self.finding(&format!(
                        "gguf: accepted expert_used_count {used} above expert_count {count}"
                    ));
                }
            }
        }
        self.check_spec(what, &out);
    }

    fn hf_round(&mut self, rng: &mut Rng) {
        let base: Value = serde_json::from_str(rng.pick(HF_SEEDS)).expect("valid seed");
        let v = if rng.chance(7, 8) {
            mutate_hf(rng, base)
        } else {
            base
        };
        let mut bytes = v.to_string().into_bytes();
        let byte_level = rng.chance(1, 5);
        if byte_level {
            bytes = mutate_bytes(rng, bytes);
        }
        let mut out = marconi_model_spec::default();
        // SAFETY: bytes has its length readable (NULL-free pointer even when
        // empty); out is writable.
        let st = self.call("marconi_model_spec_from_hf_config", || unsafe {
            marconi_model_spec_from_hf_config(bytes.as_ptr().cast(), bytes.len(), &mut out)
        });
        if !self.status_is(
            "hf config",
            st,
            &[St::Ok, St::InvalidArgument, St::InvalidConfig],
        ) || st != St::Ok
        {
            return;
        }
        if !byte_level {
            let obj = v.as_object().cloned().unwrap_or_default();
            let num = |k: &str| obj.get(k).and_then(Value::as_u64);
            let family = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
            if out.ssm_layers > 0 {
                if out.conv_kernel == 0 || CONV_KEYS.iter().any(|k| num(k) == Some(0)) {
                    self.finding(&format!("hf {family}: accepted a convolution of width 0"));
                }
                let mamba2 = !matches!(family, "mamba" | "jamba");
                if mamba2 && GROUP_KEYS.iter().any(|k| num(k) == Some(0)) {
                    self.finding(&format!(
                        "hf {family}: accepted a Mamba-2 mixer with 0 groups"
                    ));
                }
            }
            if out.moe_layers > 0 {
                let used = num("num_experts_per_tok");
                let count = EXPERT_COUNT_KEYS.iter().find_map(|k| num(k));
                match (used, count) {
                    (Some(0), _) => {
                        self.finding(&format!("hf {family}: accepted 0 experts a token"))
                    }
                    (Some(u), Some(c)) if u > c => self.finding(&format!(
                        "hf {family}: accepted {u} experts a token out of {c}"
                    )),
                    _ => {}
                }
            }
        }
        self.check_spec("hf config", &out);
    }

    /// Paths that are not regular files: refused, without blocking.
    fn path_round(&mut self, rng: &mut Rng) {
        let fifo = self.dir.join("fifo.gguf");
        let link = self.dir.join("link.gguf");
        let writer_fifo = self.dir.join("busy.gguf");
        let paths: Vec<(PathBuf, bool)> = vec![
            (fifo.clone(), false),
            (writer_fifo.clone(), false),
            (link.clone(), false),
            (self.dir.clone(), false),
            ("/dev/zero".into(), false),
            ("/dev/null".into(), false),
            (self.dir.join("missing.gguf"), false),
            (self.dir.join("missing/"), false),
        ];
        let (p, _) = rng.pick(&paths);
        let c = CString::new(p.as_os_str().as_encoded_bytes()).expect("no NUL");
        let mut out = marconi_model_spec::default();
        // SAFETY: a NUL-terminated path and a writable out.
        let st = self.call(
            &format!("marconi_model_spec_from_gguf({})", p.display()),
            || unsafe { marconi_model_spec_from_gguf(c.as_ptr(), &mut out) },
        );
        self.status_is(
            &format!("gguf path {}", p.display()),
            st,
            &[St::InvalidArgument],
        );
    }

    fn plan_round(&mut self, rng: &mut Rng) {
        let mut r = MaybeUninit::<marconi_plan_request>::uninit();
        // SAFETY: r has sizeof(marconi_plan_request) writable bytes.
        let st =
            unsafe { marconi_plan_request_init(r.as_mut_ptr(), size_of::<marconi_plan_request>()) };
        assert_eq!(st, St::Ok);
        // SAFETY: initialised above.
        let mut r = unsafe { r.assume_init() };
        let presets: Vec<CString> = marconi_core::PRESET_NAMES
            .iter()
            .map(|p| CString::new(*p).expect("no NUL"))
            .collect();
        if !self.accepted.is_empty() && rng.chance(1, 2) {
            r.model = rng.pick(&self.accepted);
        } else {
            r.model_preset = presets[rng.index(presets.len())].as_ptr();
        }
        let (x, y, z) = (rng.next(), rng.next(), rng.next());
        r.page_size = rng.pick(&[0, 1, 2, 16, 17, 4096, 1 << 20, u32::MAX, x as u32]);
        r.budget_bytes = rng.pick(&[
            0,
            1,
            1 << 20,
            1 << 30,
            10 << 30,
            1 << 40,
            u64::MAX,
            y,
            y >> 24,
        ]);
        r.state_fraction = rng.pick(&[
            0.5,
            1e-9,
            1.0 - 1e-12,
            0.0,
            1.0,
            -0.5,
            f64::NAN,
            f64::INFINITY,
            (z >> 11) as f64 / (1u64 << 53) as f64,
        ]);
        let big = [
            0,
            1,
            15,
            16,
            17,
            1 << 20,
            1 << 40,
            1 << 62,
            u64::MAX - 1,
            u64::MAX,
            x,
            z >> 40,
        ];
        r.context_tokens = rng.pick(&big);
        r.batch = rng.pick(&big);
        let mut out = versioned::<marconi_memory_plan>();
        // SAFETY: a valid request (its preset NUL-terminated, alive) and an
        // output struct of its declared size.
        let st = self.call("marconi_plan", || unsafe { marconi_plan(&r, &mut out) });
        let what = format!(
            "plan(page {}, budget {}, fraction {}, context {}, batch {})",
            r.page_size, r.budget_bytes, r.state_fraction, r.context_tokens, r.batch
        );
        if !self.status_is(&what, st, &[St::Ok, St::InvalidConfig]) || st != St::Ok {
            return;
        }
        if let Err(e) = check_plan(&r, &out) {
            self.finding(&format!("{what}: {e}"));
        }
    }
}

/// The invariants of a successful plan, recomputed in 128 bits.
fn check_plan(r: &marconi_plan_request, p: &marconi_memory_plan) -> Result<(), String> {
    let f = p.state_fraction;
    if !(f > 0.0 && f < 1.0) {
        return Err(format!("state_fraction {f} outside (0, 1)"));
    }
    let ffc = p.fraction_for_context;
    if r.context_tokens == 0 {
        if ffc != 0.0 {
            return Err(format!("fraction_for_context {ffc} for context 0"));
        }
    } else if !(ffc > 0.0 && ffc <= 1.0) {
        return Err(format!("fraction_for_context {ffc} outside (0, 1]"));
    }
    let page = u128::from(p.page_size);
    let (kvb, slot) = (u128::from(p.kv_page_bytes), u128::from(p.state_slot_bytes));
    let budget = u128::from(p.budget_bytes);
    let (kv_pages, slots) = (
        u128::from(p.split_kv_pages),
        u128::from(p.split_state_slots),
    );
    let units = u128::from(p.unified_units);
    if page == 0 || kvb == 0 || slot == 0 {
        return Err(format!("zero unit: page {page}, kv {kvb}, slot {slot}"));
    }
    if r.context_tokens > 0 {
        let pages = u128::from(r.context_tokens).div_ceil(page);
        let fits = |b: u128, l: usize| match l {
            0 => b * pages <= kv_pages && b <= slots,
            1 => b * (pages * kvb + slot) <= budget,
            _ => b * (pages + 1) <= units,
        };
        let got = [p.max_batch_static, p.max_batch_avmp, p.max_batch_unified];
        for (l, &b) in got.iter().enumerate() {
            let b = u128::from(b);
            if !fits(b, l) || fits(b + 1, l) {
                return Err(format!(
                    "max_batch {got:?} (layout {l}) is not the largest batch that fits"
                ));
            }
        }
    } else if (p.max_batch_static, p.max_batch_avmp, p.max_batch_unified) != (0, 0, 0) {
        return Err("a batch for context 0".into());
    }
    if r.batch > 0 {
        let batch = u128::from(r.batch);
        let got = [
            p.max_context_static,
            p.max_context_avmp,
            p.max_context_unified,
        ];
        for (l, &ctx) in got.iter().enumerate() {
            let ctx = u128::from(ctx);
            if ctx % page != 0 {
                return Err(format!("max_context {ctx} not whole pages"));
            }
            let n = ctx / page;
            let fits = |n: u128| match l {
                0 => batch * n <= kv_pages && batch <= slots,
                1 => batch * (n * kvb + slot) <= budget,
                _ => batch * (n + 1) <= units,
            };
            if (n > 0 && !fits(n)) || fits(n + 1) {
                return Err(format!(
                    "max_context {got:?} (layout {l}) is not the longest that fits"
                ));
            }
        }
    }
    Ok(())
}

// -------------------------------------------------------------- main ----

/// Seeded random model files and plans through libmarconi's readers
/// (GGUF, HF config.json, paths) and memory planner.
#[derive(clap::Parser)]
#[command(name = "fuzz_readers")]
struct Args {
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How many seeds to run; they stop at --seeds or at --seconds,
    /// whichever comes first.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// Calls per seed.
    #[arg(long, default_value_t = 2000)]
    calls: u64,
    /// Stop starting seeds after this many seconds.
    #[arg(long)]
    seconds: Option<f64>,
    /// Seconds a call may take before it is a finding.
    #[arg(long, default_value_t = 5.0)]
    call_timeout: f64,
    /// The kinds of round to run.
    #[arg(long, value_delimiter = ',', default_value = "gguf,hf,path,plan")]
    only: Vec<String>,
}

/// The kind of round a draw of 0..16 picks.
fn kind_of(draw: u64) -> &'static str {
    match draw {
        0..=5 => "gguf",
        6..=10 => "hf",
        11 => "path",
        _ => "plan",
    }
}

/// A FIFO at `path` (replaced if present).
fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
    // SAFETY: a NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let began = Instant::now();
    let watch = Arc::new(Watch {
        start_ms: AtomicU64::new(0),
        what: Mutex::new(String::new()),
        began,
    });
    spawn_watchdog(
        Arc::clone(&watch),
        Duration::from_secs_f64(args.call_timeout),
    );
    let dir = std::env::temp_dir().join(format!("marconi-fuzz-readers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    // The non-regular paths: a FIFO with no writer, one whose writer stays
    // open (held here: both ends, non-blocking), a symlink to a FIFO.
    mkfifo(&dir.join("fifo.gguf"));
    mkfifo(&dir.join("busy.gguf"));
    let _ = std::os::unix::fs::symlink(dir.join("fifo.gguf"), dir.join("link.gguf"));
    let busy_reader = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(dir.join("busy.gguf"))
            .expect("open the FIFO's read end")
    };
    let busy_writer = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("busy.gguf"))
        .expect("open the FIFO's write end");
    let seeds = gguf_seeds();
    let mut f = Fuzz {
        seed: 0,
        call: 0,
        calls: 0,
        findings: 0,
        watch,
        dir: dir.clone(),
        accepted: Vec::new(),
    };
    let mut per_kind: BTreeMap<&str, u64> = BTreeMap::new();
    let mut seeds_run = 0u64;
    'seeds: for seed in args.seed..args.seed.saturating_add(args.seeds) {
        f.seed = seed;
        let mut rng = Rng::new(seed);
        for call in 0..args.calls {
            if args
                .seconds
                .is_some_and(|s| began.elapsed().as_secs_f64() >= s)
            {
                break 'seeds;
            }
            f.call = call;
            let kind = match rng.below(16) {
                k if !args.only.iter().any(|o| o == kind_of(k)) => "skipped",
                0..=5 => {
                    f.gguf_round(&mut rng, &seeds);
                    "gguf"
                }
                6..=10 => {
                    f.hf_round(&mut rng);
                    "hf"
                }
                11 => {
                    f.path_round(&mut rng);
                    "path"
                }
                _ => {
                    f.plan_round(&mut rng);
                    "plan"
                }
            };
            *per_kind.entry(kind).or_default() += 1;
        }
        seeds_run += 1;
    }
    drop(busy_writer);
    drop(busy_reader);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "fuzz_readers: seeds {}..{} ({seeds_run} run), {} ABI calls ({}), {} specs kept for plans, findings {}, {:.1} s",
        args.seed,
        args.seed + seeds_run,
        f.calls,
        per_kind
            .iter()
            .map(|(k, n)| format!("{k} rounds {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        f.accepted.len(),
        f.findings,
        began.elapsed().as_secs_f64()
    );
    if f.findings > 0 {
        std::process::exit(1);
    }
}
