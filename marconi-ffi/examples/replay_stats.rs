//! Replays a JSON-lines trace (`{"input": [...], "output": [...]}` per line)
//! through `marconi_core::PrefixCache::serve` and prints the final stats as
//! one JSON object. The Python shim's tests compare it with the stats of the
//! same trace replayed through the C ABI, so the two paths cannot drift.
//!
//! Usage: `replay_stats TRACE CAPACITY_BYTES [PRESET]` (preset: paper-7b).
//! The configuration is `CacheConfig::marconi` (Marconi admission,
//! FLOP-aware eviction, α tuned online, page size 1), which is also what
//! `marconi_cache_config_init` gives.

use std::process::ExitCode;

use marconi_core::{CacheConfig, ModelSpec, PrefixCache};

fn tokens(v: &serde_json::Value, key: &str) -> Result<Vec<u32>, String> {
    v.get(key)
        .and_then(|a| a.as_array())
        .ok_or_else(|| format!("missing array {key:?}"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("bad token {t} in {key:?}"))
        })
        .collect()
}

fn run() -> Result<String, String> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: replay_stats TRACE CAPACITY_BYTES [PRESET]".into());
    }
    let text = std::fs::read_to_string(&args[1]).map_err(|e| format!("{}: {e}", args[1]))?;
    let capacity: u64 = args[2].parse().map_err(|e| format!("capacity: {e}"))?;
    let preset = args.get(3).map_or("paper-7b", String::as_str);
    let model = ModelSpec::preset(preset).ok_or_else(|| format!("unknown preset {preset}"))?;
    let mut cache =
        PrefixCache::new(CacheConfig::marconi(model, capacity)).map_err(|e| e.to_string())?;
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        let input = tokens(&v, "input")?;
        let output = tokens(&v, "output")?;
        cache
            .serve(0, &input, &output)
            .map_err(|e| format!("line {}: {e}", i + 1))?;
    }
    serde_json::to_string(&cache.stats()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    match run() {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("replay_stats: {e}");
            ExitCode::FAILURE
        }
    }
}
