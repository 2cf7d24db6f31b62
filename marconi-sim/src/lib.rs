//! # marconi-sim
//!
//! Replays request traces through libmarconi's caching policies and reports
//! hit rates, FLOPs saved and estimated time to first token; generates
//! workloads (real ShareGPT conversations, synthetic agentic and chat
//! sessions); compares policies side by side and plots the paper's figures.
//!
//! * [`trace`]: the JSON-lines trace format, a streaming reader and a writer.
//! * [`synth`] and [`sharegpt`]: workload generators.
//! * [`replay`]: one policy over one trace, sequential or concurrent.
//! * [`clairvoyant`]: the clairvoyant reference at equal capacity.
//! * [`battery`]: every policy × a battery of traces × capacities.
//! * [`compare`]: every policy over one trace in parallel, sweeps, tables.
//! * [`paper`]: the paper's end-to-end comparison over many traces (Figs. 7–9).
//! * [`pools`]: the cache over real pool layouts (static, AVMP, unified)
//!   at one memory budget.
//! * [`plot`]: SVG figures.
//! * [`pml`]: Prompt Markup Language layouts (`marconi-sim pml`).

pub mod battery;
pub mod clairvoyant;
pub mod compare;
pub mod paper;
pub mod plot;
pub mod pml;
pub mod pools;
pub mod progress;
pub mod replay;
pub mod rng;
pub mod route;
pub mod route_cli;
pub mod route_feed;
pub mod sharegpt;
pub mod synth;
pub mod tiers;
pub mod tiers_cmd;
pub mod trace;
pub mod ttft;
pub mod units;
