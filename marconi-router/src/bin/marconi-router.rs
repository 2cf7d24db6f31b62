//! `marconi-router serve --http 127.0.0.1:8090`: NVIDIA Dynamo's standalone
//! KV indexer API over libmarconi's event streams, scores capped at each
//! worker's deepest resumable state (`marconi_router::serve`).

use std::time::Duration;

use clap::{Parser, Subcommand};
use marconi_router::serve::{Register, ServeConfig, Server};

#[derive(Parser)]
#[command(name = "marconi-router", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve Dynamo's standalone indexer HTTP API (/register, /unregister,
    /// /query, /query_by_hash, /dump, /workers, /health).
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    http: String,
    /// The engines' NONE_HASH seed (vLLM's PYTHONHASHSEED or its default).
    #[arg(long, default_value = marconi_router::hash::DEFAULT_SEED)]
    seed: String,
    /// Tokens per block of the workers given with --workers.
    #[arg(long)]
    block_size: Option<u32>,
    /// Initial workers, as Dynamo's: "id[:dp_rank]=endpoint,...".
    #[arg(long)]
    workers: Option<String>,
    /// Replay endpoints of initial workers: "id[:dp_rank]=endpoint,...".
    #[arg(long)]
    replay: Option<String>,
    /// Model name of the initial workers.
    #[arg(long, default_value = "default")]
    model_name: String,
    /// Routing group of the initial workers.
    #[arg(long, default_value = "default")]
    routing_group: String,
    /// Milliseconds a gap replay may take before the worker is cleared.
    #[arg(long, default_value_t = 2000)]
    replay_timeout_ms: u64,
    /// Milliseconds a client may take to send a request's headers (an idle
    /// kept-open connection is closed after as long).
    #[arg(long, default_value_t = 30_000)]
    header_timeout_ms: u64,
    /// Milliseconds a client may take to send a request's body (then 408).
    #[arg(long, default_value_t = 30_000)]
    body_timeout_ms: u64,
    /// Connections served at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
}

/// "id[:rank]=endpoint,..." as (id, rank, endpoint).
fn parse_workers(s: &str) -> Result<Vec<(u64, u32, String)>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (who, ep) = p
                .split_once('=')
                .ok_or_else(|| format!("{p}: expected id[:dp_rank]=endpoint"))?;
            let (id, rank) = who.split_once(':').unwrap_or((who, "0"));
            let id = id.parse().map_err(|e| format!("{p}: instance id: {e}"))?;
            let rank = rank.parse().map_err(|e| format!("{p}: dp_rank: {e}"))?;
            Ok((id, rank, ep.to_string()))
        })
        .collect()
}

fn serve(a: ServeArgs) -> Result<(), String> {
    let replays = parse_workers(a.replay.as_deref().unwrap_or(""))?;
    let initial = match &a.workers {
        Some(w) => Some((
            a.block_size.ok_or("--workers needs --block-size")?,
            parse_workers(w)?,
        )),
        None => None,
    };
    let server = Server::bind(
        &a.http,
        ServeConfig {
            seed: a.seed,
            replay_timeout: Duration::from_millis(a.replay_timeout_ms),
            header_timeout: Duration::from_millis(a.header_timeout_ms),
            body_timeout: Duration::from_millis(a.body_timeout_ms),
            max_connections: a.max_connections,
        },
    )
    .map_err(|e| format!("listen on {}: {e}", a.http))?;
    if let Some((bs, workers)) = initial {
        for (id, rank, ep) in workers {
            let replay = replays
                .iter()
                .find(|r| r.0 == id && r.1 == rank)
                .map(|r| r.2.clone());
            let (status, body) = server.register(Register {
                instance_id: id,
                endpoint: ep,
                model_name: a.model_name.clone(),
                block_size: bs,
                routing_group: a.routing_group.clone(),
                dp_rank: rank,
                replay_endpoint: replay,
                additional_salt: None,
                tenant_id: None,
                attention_only: false,
            });
            if status >= 300 {
                return Err(format!("worker {id}:{rank}: {body}"));
            }
        }
    }
    eprintln!("marconi-router: serving on http://{}", server.local_addr());
    server.wait();
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve(a),
    };
    if let Err(e) = r {
        eprintln!("marconi-router: {e}");
        std::process::exit(2);
    }
}
