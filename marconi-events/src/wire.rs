//! The wire events (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`)
//! and their MessagePack form, byte for byte as msgspec writes vLLM's
//! structs (docs/events.md §3), in both layouts; and a decoder that reads
//! either layout (for subscribers and tests).

use std::io::Cursor;

use rmp::encode as enc;

use crate::hash::{Digest32, Namespaces};

/// Group of the attention KV blocks.
pub const GROUP_KV: u32 = 0;
/// Group of the recurrent states (marconi's extension, docs/events.md §4).
pub const GROUP_STATE: u32 = 1;

/// How block hashes go on the wire (`ExternalBlockHash`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashFormat {
    /// The last 8 bytes of the digest as an unsigned integer (vLLM's default).
    #[default]
    Int,
    /// The 32-byte digest as msgpack `bin`.
    Bytes,
}

/// How events are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Tagged maps (vLLM after PR #42892).
    #[default]
    Map,
    /// Tagged arrays, every field present (earlier vLLM).
    Array,
}

/// A block hash as carried by an event: the full digest (the wire form is
/// chosen when encoding).
pub type WireHash = Digest32;

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    /// vLLM's `BlockStored`.
    BlockStored {
        /// One digest per block, in chain order.
        block_hashes: Vec<WireHash>,
        /// The block before the first one; `None` at the start of a chain.
        parent_block_hash: Option<WireHash>,
        /// The blocks' tokens (a state event: the tokens from its block's
        /// start to its position).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The namespace (0: none), published as [`WireOptions::namespaces`] says.
        ns: u64,
        /// [`GROUP_KV`] or [`GROUP_STATE`].
        group_idx: u32,
        /// A state event's position (`state_position`).
        state_position: Option<u32>,
    },
    /// vLLM's `BlockRemoved`.
    BlockRemoved {
        /// The removed blocks' digests.
        block_hashes: Vec<WireHash>,
        /// [`GROUP_KV`] or [`GROUP_STATE`].
        group_idx: u32,
    },
    /// vLLM's `AllBlocksCleared`.
    AllBlocksCleared,
}

/// How a batch is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireOptions {
    /// Hash form.
    pub hash_format: HashFormat,
    /// Event layout.
    pub layout: Layout,
    /// The `medium` string.
    pub medium: String,
    /// The batch's `data_parallel_rank`.
    pub data_parallel_rank: i64,
    /// How namespaces are published (and hashed: the encoder's hasher
    /// follows this).
    pub namespaces: Namespaces,
}

impl Default for WireOptions {
    fn default() -> Self {
        WireOptions {
            hash_format: HashFormat::Int,
            layout: Layout::Map,
            medium: "GPU".into(),
            data_parallel_rank: 0,
            namespaces: Namespaces::default(),
        }
    }
}

fn kind(group: u32) -> &'static str {
    if group == GROUP_STATE {
        "mamba"
    } else {
        "full_attention"
    }
}

// Writes into a Vec cannot fail; rmp's Result is only for the io::Write.
fn ok<T, E: std::fmt::Debug>(r: Result<T, E>) {
    r.expect("writing to a Vec cannot fail");
}

fn write_hash(buf: &mut Vec<u8>, h: &WireHash, f: HashFormat) {
    match f {
        HashFormat::Int => ok(enc::write_uint(buf, crate::hash::external(h))),
        HashFormat::Bytes => ok(enc::write_bin(buf, h)),
    }
}

fn write_hashes(buf: &mut Vec<u8>, hs: &[WireHash], f: HashFormat) {
    ok(enc::write_array_len(buf, hs.len() as u32));
    for h in hs {
        write_hash(buf, h, f);
    }
}

fn write_opt_hash(buf: &mut Vec<u8>, h: &Option<WireHash>, f: HashFormat) {
    match h {
        Some(h) => write_hash(buf, h, f),
        None => ok(enc::write_nil(buf)),
    }
}

fn write_tokens(buf: &mut Vec<u8>, ts: &[u32]) {
    ok(enc::write_array_len(buf, ts.len() as u32));
    for &t in ts {
        ok(enc::write_uint(buf, u64::from(t)));
    }
}

/// `extra_keys`, one entry per block (vLLM's untagged form): the first
/// block of a chain is the one whose parent is `None`.
fn write_extra(buf: &mut Vec<u8>, blocks: usize, ns: u64, first_is_root: bool, m: Namespaces) {
    let name = ns.to_string();
    ok(enc::write_array_len(buf, blocks as u32));
    for i in 0..blocks {
        match m {
            Namespaces::CacheSalt if i > 0 || !first_is_root => ok(enc::write_nil(buf)),
            Namespaces::CacheSalt | Namespaces::Lora => {
                ok(enc::write_array_len(buf, 1));
                ok(enc::write_str(buf, &name));
            }
            Namespaces::ExtraKeys => {
                ok(enc::write_array_len(buf, 1));
                ok(enc::write_uint(buf, ns));
            }
        }
    }
}

/// `lora_id` and `lora_name`: a namespace's number and name under
/// [`Namespaces::Lora`], else `nil`.
fn write_lora(buf: &mut Vec<u8>, ns: u64, m: Namespaces, name_field: bool) {
    if ns == 0 || m != Namespaces::Lora {
        ok(enc::write_nil(buf));
    } else if name_field {
        ok(enc::write_str(buf, &ns.to_string()));
    } else {
        ok(enc::write_uint(buf, ns));
    }
}

/// Appends one event.
pub fn write_event(buf: &mut Vec<u8>, e: &WireEvent, o: &WireOptions) {
    let f = o.hash_format;
    match (e, o.layout) {
        (
            WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ns,
                group_idx,
                state_position,
            },
            Layout::Map,
        ) => {
            let n = 10 + usize::from(*ns != 0) + usize::from(state_position.is_some());
            ok(enc::write_map_len(buf, n as u32));
            ok(enc::write_str(buf, "type"));
            ok(enc::write_str(buf, "BlockStored"));
            ok(enc::write_str(buf, "block_hashes"));
            write_hashes(buf, block_hashes, f);
            ok(enc::write_str(buf, "parent_block_hash"));
            write_opt_hash(buf, parent_block_hash, f);
            ok(enc::write_str(buf, "token_ids"));
            write_tokens(buf, token_ids);
            ok(enc::write_str(buf, "block_size"));
            ok(enc::write_uint(buf, u64::from(*block_size)));
            ok(enc::write_str(buf, "lora_id"));
            write_lora(buf, *ns, o.namespaces, false);
            ok(enc::write_str(buf, "medium"));
            ok(enc::write_str(buf, &o.medium));
            ok(enc::write_str(buf, "lora_name"));
            write_lora(buf, *ns, o.namespaces, true);
            if *ns != 0 {
                ok(enc::write_str(buf, "extra_keys"));
                let root = parent_block_hash.is_none();
                write_extra(buf, block_hashes.len(), *ns, root, o.namespaces);
            }
            ok(enc::write_str(buf, "group_idx"));
            ok(enc::write_uint(buf, u64::from(*group_idx)));
            ok(enc::write_str(buf, "kv_cache_spec_kind"));
            ok(enc::write_str(buf, kind(*group_idx)));
            if let Some(p) = state_position {
                ok(enc::write_str(buf, "state_position"));
                ok(enc::write_uint(buf, u64::from(*p)));
            }
        }
        (
            WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ns,
                group_idx,
                state_position,
            },
            Layout::Array,
        ) => {
            ok(enc::write_array_len(
                buf,
                12 + u32::from(state_position.is_some()),
            ));
            ok(enc::write_str(buf, "BlockStored"));
            write_hashes(buf, block_hashes, f);
            write_opt_hash(buf, parent_block_hash, f);
            write_tokens(buf, token_ids);
            ok(enc::write_uint(buf, u64::from(*block_size)));
            write_lora(buf, *ns, o.namespaces, false);
            ok(enc::write_str(buf, &o.medium));
            write_lora(buf, *ns, o.namespaces, true);
            if *ns != 0 {
                let root = parent_block_hash.is_none();
                write_extra(buf, block_hashes.len(), *ns, root, o.namespaces);
            } else {
                ok(enc::write_nil(buf));
            }
            ok(enc::write_uint(buf, u64::from(*group_idx)));
            ok(enc::write_str(buf, kind(*group_idx)));
            ok(enc::write_nil(buf)); // kv_cache_spec_sliding_window
            if let Some(p) = state_position {
                ok(enc::write_uint(buf, u64::from(*p)));
            }
        }
        (
            WireEvent::BlockRemoved {
                block_hashes,
                group_idx,
            },
            layout,
        ) => {
            if layout == Layout::Map {
                ok(enc::write_map_len(buf, 4));
                ok(enc::write_str(buf, "type"));
            } else {
                ok(enc::write_array_len(buf, 4));
            }
            ok(enc::write_str(buf, "BlockRemoved"));
            if layout == Layout::Map {
                ok(enc::write_str(buf, "block_hashes"));
            }
            write_hashes(buf, block_hashes, f);
            if layout == Layout::Map {
                ok(enc::write_str(buf, "medium"));
            }
            ok(enc::write_str(buf, &o.medium));
            if layout == Layout::Map {
                ok(enc::write_str(buf, "group_idx"));
            }
            ok(enc::write_uint(buf, u64::from(*group_idx)));
        }
        (WireEvent::AllBlocksCleared, Layout::Map) => {
            ok(enc::write_map_len(buf, 1));
            ok(enc::write_str(buf, "type"));
            ok(enc::write_str(buf, "AllBlocksCleared"));
        }
        (WireEvent::AllBlocksCleared, Layout::Array) => {
            ok(enc::write_array_len(buf, 1));
            ok(enc::write_str(buf, "AllBlocksCleared"));
        }
    }
}

/// One `KVEventBatch`: `[ts, events, data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[WireEvent], o: &WireOptions) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    ok(enc::write_array_len(&mut buf, 3));
    ok(enc::write_f64(&mut buf, ts));
    ok(enc::write_array_len(&mut buf, events.len() as u32));
    for e in events {
        write_event(&mut buf, e, o);
    }
    ok(enc::write_sint(&mut buf, o.data_parallel_rank));
    buf
}

// ---- decoding -------------------------------------------------------------

/// A decoded event, hashes in vLLM's integer form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodedEvent {
    /// `BlockStored`.
    BlockStored {
        /// Block hashes (integer form; a 32-byte hash is read as its last 8 bytes).
        block_hashes: Vec<u64>,
        /// Parent hash.
        parent_block_hash: Option<u64>,
        /// Tokens.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// `group_idx` (absent: 0).
        group_idx: u32,
        /// `state_position` (marconi's extension).
        state_position: Option<u32>,
    },
    /// `BlockRemoved`.
    BlockRemoved {
        /// Block hashes.
        block_hashes: Vec<u64>,
        /// `group_idx` (absent: 0).
        group_idx: u32,
    },
    /// `AllBlocksCleared`.
    AllBlocksCleared,
}

/// A decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// Timestamp.
    pub ts: f64,
    /// Known events in order.
    pub events: Vec<DecodedEvent>,
    /// `data_parallel_rank`, if present.
    pub data_parallel_rank: Option<i64>,
    /// Events of an unknown type, skipped.
    pub unknown: usize,
}

/// Why a payload could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed event batch: {0}")]
pub struct DecodeError(pub String);

type V = rmpv::Value;

fn err<T>(s: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(s.into()))
}

fn as_hash(v: &V) -> Result<u64, DecodeError> {
    match v {
        V::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| DecodeError(format!("bad hash {v}"))),
        V::Binary(b) if b.len() >= 8 => {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[b.len() - 8..]);
            Ok(u64::from_be_bytes(x))
        }
        _ => err(format!("bad hash {v}")),
    }
}

fn as_hashes(v: &V) -> Result<Vec<u64>, DecodeError> {
    v.as_array()
        .ok_or_else(|| DecodeError(format!("block_hashes is not an array: {v}")))?
        .iter()
        .map(as_hash)
        .collect()
}

fn as_u32(v: &V, what: &str) -> Result<u32, DecodeError> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| DecodeError(format!("{what} is not a u32: {v}")))
}

fn opt_u32(v: Option<&V>, what: &str) -> Result<Option<u32>, DecodeError> {
    match v {
        None | Some(V::Nil) => Ok(None),
        Some(x) => as_u32(x, what).map(Some),
    }
}

/// Fields by name, from either layout.
fn fields<'a>(v: &'a V, names: &[&str]) -> Result<(String, Vec<Option<&'a V>>), DecodeError> {
    match v {
        V::Map(m) => {
            let get = |k: &str| {
                m.iter()
                    .find(|(kk, _)| kk.as_str() == Some(k))
                    .map(|(_, x)| x)
            };
            let tag = get("type")
                .and_then(V::as_str)
                .ok_or_else(|| DecodeError("event map without a type".into()))?;
            Ok((tag.to_string(), names.iter().map(|n| get(n)).collect()))
        }
        V::Array(a) => {
            let tag = a
                .first()
                .and_then(V::as_str)
                .ok_or_else(|| DecodeError("event array without a tag".into()))?;
            Ok((
                tag.to_string(),
                (0..names.len()).map(|i| a.get(i + 1)).collect(),
            ))
        }
        _ => err(format!("event is neither a map nor an array: {v}")),
    }
}

const STORED: [&str; 12] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "state_position",
];
const REMOVED: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn decode_event(v: &V) -> Result<Option<DecodedEvent>, DecodeError> {
    let tag = match v {
        V::Map(_) | V::Array(_) => fields(v, &[])?.0,
        _ => return err(format!("event is neither a map nor an array: {v}")),
    };
    match tag.as_str() {
        "BlockStored" => {
            let (_, f) = fields(v, &STORED)?;
            let need = |i: usize| f[i].ok_or_else(|| DecodeError(format!("missing {}", STORED[i])));
            let parent = match need(1)? {
                V::Nil => None,
                x => Some(as_hash(x)?),
            };
            let tokens = need(2)?
                .as_array()
                .ok_or_else(|| DecodeError("token_ids is not an array".into()))?
                .iter()
                .map(|t| as_u32(t, "token"))
                .collect::<Result<_, _>>()?;
            Ok(Some(DecodedEvent::BlockStored {
                block_hashes: as_hashes(need(0)?)?,
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: as_u32(need(3)?, "block_size")?,
                group_idx: opt_u32(f[8], "group_idx")?.unwrap_or(0),
                state_position: opt_u32(f[11], "state_position")?,
            }))
        }
        "BlockRemoved" => {
            let (_, f) = fields(v, &REMOVED)?;
            let hashes = f[0].ok_or_else(|| DecodeError("missing block_hashes".into()))?;
            Ok(Some(DecodedEvent::BlockRemoved {
                block_hashes: as_hashes(hashes)?,
                group_idx: opt_u32(f[2], "group_idx")?.unwrap_or(0),
            }))
        }
        "AllBlocksCleared" => Ok(Some(DecodedEvent::AllBlocksCleared)),
        _ => Ok(None),
    }
}

/// Decodes one payload (either layout; the batch as an array of 2 or 3, or
/// a map). Unknown event types are counted and skipped.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut cur = Cursor::new(payload);
    let v = rmpv::decode::read_value(&mut cur).map_err(|e| DecodeError(e.to_string()))?;
    if (cur.position() as usize) != payload.len() {
        return err("trailing bytes after the batch");
    }
    let (ts, events, rank) = match &v {
        V::Array(a) if (2..=3).contains(&a.len()) => (&a[0], &a[1], a.get(2)),
        V::Map(m) => {
            let get = |k: &str| {
                m.iter()
                    .find(|(kk, _)| kk.as_str() == Some(k))
                    .map(|(_, x)| x)
            };
            (
                get("ts").ok_or_else(|| DecodeError("batch without ts".into()))?,
                get("events").ok_or_else(|| DecodeError("batch without events".into()))?,
                get("data_parallel_rank"),
            )
        }
        _ => return err(format!("batch is not [ts, events, rank]: {v}")),
    };
    let ts = ts
        .as_f64()
        .ok_or_else(|| DecodeError(format!("ts is not a number: {ts}")))?;
    let mut out = DecodedBatch {
        ts,
        events: Vec::new(),
        data_parallel_rank: rank.and_then(V::as_i64),
        unknown: 0,
    };
    for e in events
        .as_array()
        .ok_or_else(|| DecodeError("events is not an array".into()))?
    {
        match decode_event(e)? {
            Some(d) => out.events.push(d),
            None => out.unknown += 1,
        }
    }
    Ok(out)
}
