//! Replays through a device cache with host and store tiers below it
//! (`marconi_core::TieredCache`): the `--tiers device:10GB,host:80GB[,store:1TB]`
//! flag of `replay`, `compare` and `battery`, the transfer model and the
//! per-tier report.
//!
//! TTFT charges the loads: the TTFT model's prefill time of the tokens
//! not reused, plus the modelled load time of the lower-tier hit
//! (bytes / bandwidth + a per-load latency, per tier read).

use std::time::Instant;

use marconi_core::{CacheConfig, Tier, TierConfig, TierSpec, TieredCache, WriteMode};
use serde::Serialize;

use crate::replay::{percentile, Outcome, Policy, Replay, ReplayConfig, ReplayError, Report};
use crate::trace::Trace;
use crate::units::parse_bytes;

/// Tier sizes in bytes, as `--tiers` gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierSizes {
    /// The device tier (the cache's capacity).
    pub device: u64,
    /// The host tier.
    pub host: Option<u64>,
    /// The store tier (needs a host tier).
    pub store: Option<u64>,
}

/// Parses `device:10GB,host:80GB[,store:1TB]`: a device size, then
/// optionally a host size, then optionally a store size, each at least one
/// byte, in that order.
pub fn parse_tiers(s: &str) -> Result<TierSizes, String> {
    let mut sizes = [None; 3];
    let names = ["device", "host", "store"];
    let mut next = 0;
    for part in s.split(',') {
        let (name, size) = part
            .split_once(':')
            .ok_or_else(|| format!("{part:?}: expected tier:size, such as host:80GB"))?;
        let i = names
            .iter()
            .position(|n| *n == name.trim())
            .ok_or_else(|| format!("{name:?}: unknown tier (device, host, store)"))?;
        if i < next {
            return Err(format!(
                "{s:?}: tiers go device, host, store, each at most once"
            ));
        }
        let b = parse_bytes(size)?;
        if b == 0 {
            return Err(format!("{part:?}: a tier of 0 bytes holds nothing"));
        }
        sizes[i] = Some(b);
        next = i + 1;
    }
    let device = sizes[0].ok_or_else(|| format!("{s:?}: the device tier is missing"))?;
    if sizes[2].is_some() && sizes[1].is_none() {
        return Err(format!("{s:?}: a store tier needs a host tier"));
    }
    Ok(TierSizes {
        device,
        host: sizes[1],
        store: sizes[2],
    })
}

/// How the lower tiers are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierPolicy {
    /// Marconi in every tier: the replayed policy's cache at each size,
    /// write-back demotion, a hit loaded only when that beats recomputing.
    Marconi,
    /// The HiCache-like baseline: LRU in every tier (SGLang+'s cache),
    /// write-through, every longer hit loaded.
    Hicache,
}

/// Write mode as a flag value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WriteArg {
    /// Demote on eviction.
    Back,
    /// Copy down on store.
    Through,
}

/// Everything a tiered replay needs besides the device's policy.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSim {
    /// Sizes.
    pub sizes: TierSizes,
    /// Policy family of the tiers.
    pub policy: TierPolicy,
    /// Write mode (default: the policy's).
    pub write: Option<WriteMode>,
    /// Promotion of a lower-tier hit's state to the device (default: the
    /// policy's: off for marconi, on for hicache).
    pub promote: Option<bool>,
    /// Host → device bandwidth, bytes/s.
    pub host_bandwidth: f64,
    /// Store → device bandwidth, bytes/s.
    pub store_bandwidth: f64,
    /// Per-load latency of the host, seconds.
    pub host_latency: f64,
    /// Per-load latency of the store, seconds.
    pub store_latency: f64,
    /// Effective prefill FLOP/s (load vs recompute).
    pub compute_flops: f64,
    /// A fixed α for the lower tiers' FLOP-aware eviction (default: tuned
    /// online like the device's).
    pub lower_alpha: Option<f64>,
    /// Marconi only: the device plans the lower tiers' branch checkpoints
    /// (default on).
    pub lower_plans: bool,
    /// Load every longer lower-tier hit without weighing it against
    /// recomputing (default: the policy's; hicache always loads).
    pub always_load: Option<bool>,
    /// Exclusive tiers: a served lower-tier chain is dropped there once the
    /// device holds it (default: the policy's: on for marconi, off for
    /// hicache).
    pub exclusive: Option<bool>,
}

impl TierSim {
    /// Defaults: Marconi, host 25 GB/s and 10 µs per load (PCIe 4/5 x16
    /// class), store 5 GB/s and 1 ms per load (NVMe or a fast network
    /// store), 989e12 × 0.4 FLOP/s.
    pub fn new(sizes: TierSizes) -> Self {
        TierSim {
            sizes,
            policy: TierPolicy::Marconi,
            write: None,
            promote: None,
            host_bandwidth: 25e9,
            store_bandwidth: 5e9,
            host_latency: 10e-6,
            store_latency: 1e-3,
            compute_flops: 989e12 * 0.4,
            lower_alpha: None,
            lower_plans: true,
            always_load: None,
            exclusive: None,
        }
    }

    /// The same tiers with the device at `device` bytes and the lower
    /// tiers at the same multiples of it (the battery's capacities).
    pub fn scaled_to(&self, device: u64) -> TierSim {
        let k = device as f64 / self.sizes.device as f64;
        let scale = |b: u64| ((b as f64 * k) as u64).max(1);
        TierSim {
            sizes: TierSizes {
                device,
                host: self.sizes.host.map(scale),
                store: self.sizes.store.map(scale),
            },
            ..self.clone()
        }
    }

    /// The device's configuration and the tiers' for `cfg`'s policy
    /// (`None` for the policies that are not a core cache).
    pub fn configs(&self, cfg: &ReplayConfig) -> Option<(CacheConfig, TierConfig)> {
        let at = |bytes: u64| -> Option<CacheConfig> {
            match self.policy {
                TierPolicy::Marconi => ReplayConfig {
                    capacity_bytes: bytes,
                    ..cfg.clone()
                }
                .cache_config(),
                TierPolicy::Hicache => match cfg.policy {
                    Policy::NoCache | Policy::Clairvoyant | Policy::Oracle => None,
                    _ => Some(CacheConfig::sglang_plus(cfg.model.clone(), bytes)),
                },
            }
        };
        let device = at(self.sizes.device)?;
        if cfg.policy == Policy::Oracle {
            return None;
        }
        let spec = |b: Option<u64>, bw: f64, lat: f64| -> Option<TierSpec> {
            let mut c = at(b?)?;
            if let (Some(a), marconi_core::AlphaMode::Auto(_)) = (self.lower_alpha, &c.alpha) {
                c.alpha = marconi_core::AlphaMode::Fixed(a);
            }
            Some(TierSpec {
                cache: c,
                bandwidth_bytes_per_s: bw,
                latency_s: lat,
            })
        };
        let host = spec(self.sizes.host, self.host_bandwidth, self.host_latency);
        let store = spec(self.sizes.store, self.store_bandwidth, self.store_latency);
        let mut t = match self.policy {
            TierPolicy::Marconi => TierConfig::marconi(host, store),
            TierPolicy::Hicache => TierConfig::hicache(host, store),
        };
        t.compute_flops = self.compute_flops;
        if let Some(p) = self.promote {
            t.promote = p;
        }
        t.lower_plans &= self.lower_plans;
        if let Some(a) = self.always_load {
            t.always_load = a;
        }
        if let Some(w) = self.write {
            t.write = w;
        }
        if let Some(e) = self.exclusive {
            t.exclusive = e;
        }
        Some((device, t))
    }

    /// A short name of the variant (`marconi`, `hicache`, with `/through`,
    /// `/back`, `/promote`, `/no-promote` where they differ from the
    /// policy's default).
    pub fn label(&self) -> String {
        let (name, default_write, default_promote, default_exclusive) = match self.policy {
            TierPolicy::Marconi => ("marconi", WriteMode::Back, false, true),
            TierPolicy::Hicache => ("hicache", WriteMode::Through, true, false),
        };
        let mut s = name.to_string();
        match self.write {
            Some(w) if w != default_write => s.push_str(if w == WriteMode::Back {
                "/back"
            } else {
                "/through"
            }),
            _ => {}
        }
        match self.promote {
            Some(true) if !default_promote => s.push_str("/promote"),
            Some(false) if default_promote => s.push_str("/no-promote"),
            _ => {}
        }
        if !self.lower_plans {
            s.push_str("/no-lower-plans");
        }
        match self.exclusive {
            Some(true) if !default_exclusive => s.push_str("/exclusive"),
            Some(false) if default_exclusive => s.push_str("/inclusive"),
            _ => {}
        }
        if self.always_load == Some(true) && self.policy == TierPolicy::Marconi {
            s.push_str("/always-load");
        }
        s
    }
}

/// The tiers part of a [`Report`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierReport {
    /// The tier policy's label ([`TierSim::label`]).
    pub tier_policy: String,
    /// Capacity of the device, host and store tiers (0: absent).
    pub capacity_bytes: [u64; 3],
    /// Bytes held at the end per tier.
    pub used_bytes: [u64; 3],
    /// Token hit rate by the tier of the state resumed from (device, host,
    /// store); they sum to `token_hit_rate`.
    pub token_hit_rate_by_tier: [f64; 3],
    /// Requests that resumed from each tier.
    pub hits_by_tier: [u64; 3],
    /// Bytes loaded from each tier into the device.
    pub bytes_loaded: [u64; 3],
    /// Bytes written into each tier (demotion or write-through).
    pub bytes_written: [u64; 3],
    /// Longer lower-tier hits left unused: recomputing was faster.
    pub loads_declined: u64,
    /// Entries not demoted: reloading them would cost more than recomputing.
    pub demotions_skipped: u64,
    /// Mean modelled load time per request, ms.
    pub load_ms_mean: f64,
}

/// Replays `trace` sequentially through a tiered cache: `cfg`'s policy in
/// the device at `tiers.sizes.device`, the tiers below it.
pub fn replay_tiered(
    trace: &Trace,
    cfg: &ReplayConfig,
    tiers: &TierSim,
    progress: &mut dyn FnMut(u64),
) -> Result<Replay, ReplayError> {
    let start = Instant::now();
    let bad = |s: &str| ReplayError::Config(marconi_core::CacheError::InvalidConfig(s.to_string()));
    if cfg.concurrent {
        return Err(bad("--tiers replays are sequential (no --concurrent)"));
    }
    let (dev, tc) = tiers.configs(cfg).ok_or_else(|| {
        bad("--tiers applies to the core policies (not no-cache, oracle, clairvoyant)")
    })?;
    let mut cache = TieredCache::new(dev, tc).map_err(ReplayError::Config)?;
    let mut outcomes = Vec::with_capacity(trace.len());
    let mut err = None;
    let hinted = cfg.policy == Policy::MarconiHinted;
    trace.for_each(|r| {
        if err.is_some() {
            return;
        }
        let hints = if hinted { trace.hints(&r) } else { Vec::new() };
        match cache.serve_full_hinted(0, r.input_len, r.full, &hints) {
            Ok(l) => {
                let ttft = cfg
                    .ttft
                    .ttft_ms(&cfg.model, l.hit_tokens as usize, r.input_len);
                outcomes.push(Outcome {
                    input_len: r.input_len as u32,
                    hit_tokens: l.hit_tokens,
                    ttft_ms: ttft + 1000.0 * l.load_s,
                });
                if outcomes.len() % 256 == 0 {
                    progress(outcomes.len() as u64);
                }
            }
            Err(source) => err = Some(ReplayError::Request { id: r.id, source }),
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    progress(outcomes.len() as u64);
    let s = cache.stats().clone();
    let dstats = cache.device().stats();
    let mut ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms).collect();
    ttfts.sort_by(f64::total_cmp);
    let n = outcomes.len().max(1) as f64;
    let tiers_report = TierReport {
        tier_policy: tiers.label(),
        capacity_bytes: cache.capacity_bytes(),
        used_bytes: cache.used_bytes(),
        token_hit_rate_by_tier: [Tier::Device, Tier::Host, Tier::Store].map(|t| s.tier_hit_rate(t)),
        hits_by_tier: s.hits_by_tier,
        bytes_loaded: s.bytes_loaded,
        bytes_written: s.bytes_written,
        loads_declined: s.loads_declined,
        demotions_skipped: s.demotions_skipped,
        load_ms_mean: 1000.0 * s.load_s / n,
    };
    let report = Report {
        policy: cfg.policy.name().into(),
        model: cfg.model.name.clone(),
        capacity_bytes: tiers.sizes.device,
        concurrent: false,
        requests: s.requests,
        input_tokens: s.input_tokens,
        hit_tokens: s.hit_tokens,
        token_hit_rate: s.token_hit_rate(),
        request_hit_rate: (s.hits_by_tier.iter().sum::<u64>() as f64) / n,
        kv_matched_unusable_tokens: dstats.kv_matched_unusable_tokens,
        flops_saved: s.flops_saved,
        flop_savings_rate: if s.flops_total > 0.0 {
            s.flops_saved / s.flops_total
        } else {
            0.0
        },
        ttft_p50_ms: percentile(&ttfts, 0.50),
        ttft_p95_ms: percentile(&ttfts, 0.95),
        ttft_mean_ms: ttfts.iter().sum::<f64>() / n,
        evictions: dstats.evictions,
        states_admitted: dstats.states_admitted,
        admissions_rejected: dstats.admissions_rejected,
        admissions_truncated: dstats.admissions_truncated,
        alpha: dstats.alpha,
        tuning_rounds: dstats.tuning_rounds,
        used_bytes: cache.device().used_bytes(),
        wall_s: start.elapsed().as_secs_f64(),
        tiers: Some(tiers_report),
    };
    Ok(Replay { report, outcomes })
}

/// The tier flags of `replay`, `compare` and `battery`.
#[derive(clap::Args, Clone, Debug)]
pub struct TierArgs {
    /// Tiers below the device: `device:10GB,host:80GB[,store:1TB]` (the
    /// device size replaces --capacity; in `battery`, the host and store
    /// keep their multiple of the device at every capacity). Hits from any
    /// tier count in `token_hit_rate`.
    #[arg(long, value_parser = parse_tiers)]
    pub tiers: Option<TierSizes>,
    /// How the tiers are run: marconi (utility in every tier, write-back,
    /// loads that beat recomputing) or hicache (LRU, write-through, every
    /// longer hit loaded).
    #[arg(long, value_enum, default_value_t = TierPolicy::Marconi)]
    pub tier_policy: TierPolicy,
    /// Write mode (default: back for marconi, through for hicache).
    #[arg(long, value_enum)]
    pub tier_write: Option<WriteArg>,
    /// Save a lower-tier hit's state on the device too (default: false for
    /// marconi, true for hicache).
    #[arg(long)]
    pub tier_promote: Option<bool>,
    /// Host → device bandwidth, GB/s.
    #[arg(long, default_value_t = 25.0, value_parser = positive)]
    pub host_gbps: f64,
    /// Store → device bandwidth, GB/s.
    #[arg(long, default_value_t = 5.0, value_parser = positive)]
    pub store_gbps: f64,
    /// Latency of one load from the host, µs.
    #[arg(long, default_value_t = 10.0, value_parser = non_negative)]
    pub host_latency_us: f64,
    /// Latency of one load from the store, µs.
    #[arg(long, default_value_t = 1000.0, value_parser = non_negative)]
    pub store_latency_us: f64,
    /// A fixed α for the lower tiers (default: tuned online).
    #[arg(long, value_parser = non_negative)]
    pub tier_alpha: Option<f64>,
    /// Exclusive tiers: a lower tier drops a chain it served once the
    /// device holds it (default: true for marconi, false for hicache).
    #[arg(long)]
    pub tier_exclusive: Option<bool>,
}

/// A clap value parser: a finite number > 0 (the binary's flags use it too).
pub fn positive(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(format!("{x} is not a finite number > 0"))
    }
}

/// A clap value parser: a finite number >= 0 (the binary's flags use it too).
pub fn non_negative(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(format!("{x} is not a finite number >= 0"))
    }
}

impl TierArgs {
    /// The tiers the flags describe (`None` without `--tiers`);
    /// `compute_flops` is the device's effective prefill FLOP/s.
    pub fn sim(&self, compute_flops: f64) -> Option<TierSim> {
        let sizes = self.tiers?;
        Some(TierSim {
            policy: self.tier_policy,
            write: self.tier_write.map(|w| match w {
                WriteArg::Back => WriteMode::Back,
                WriteArg::Through => WriteMode::Through,
            }),
            promote: self.tier_promote,
            host_bandwidth: self.host_gbps * 1e9,
            store_bandwidth: self.store_gbps * 1e9,
            host_latency: self.host_latency_us * 1e-6,
            store_latency: self.store_latency_us * 1e-6,
            compute_flops,
            lower_alpha: self.tier_alpha,
            exclusive: self.tier_exclusive,
            ..TierSim::new(sizes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tiers() {
        assert_eq!(
            parse_tiers("device:10GB,host:80GB,store:1TB"),
            Ok(TierSizes {
                device: 10_000_000_000,
                host: Some(80_000_000_000),
                store: Some(1_000_000_000_000),
            })
        );
        assert_eq!(
            parse_tiers("device:1GiB"),
            Ok(TierSizes {
                device: 1 << 30,
                host: None,
                store: None
            })
        );
        for bad in [
            "",
            "host:80GB",
            "device:10GB,store:1TB",
            "host:1GB,device:1GB",
            "device:10GB,device:1GB",
            "device:0GB",
            "device:10GB,disk:1TB",
            "device10GB",
            "device:10QB",
        ] {
            assert!(parse_tiers(bad).is_err(), "{bad:?} accepted");
        }
    }
}
