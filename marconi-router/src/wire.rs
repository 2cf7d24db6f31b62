//! Decoding a `KVEventBatch` payload (`docs/events.md` §3–4) into index
//! events, written from the document: a reader over the msgpack bytes
//! (markers from `rmp`), no intermediate value tree, every length checked
//! against the bytes left, nesting bounded. Malformed input is an error,
//! never a panic.
//!
//! Accepted: the batch as an array `[ts, events, data_parallel_rank?]` or
//! as a map with those keys; each event as a tagged map (`"type"` key,
//! fields by name, unknown keys skipped) or as a tagged array (legacy
//! layout, fields by position, missing trailing fields take their
//! defaults); block hashes as integers or as 32-byte digests (their last 8
//! bytes, big endian). Groups: group 0 (or none) is attention KV; a group
//! announced with `kv_cache_spec_kind = "mamba"`, or group 1 before any
//! announcement, holds recurrent states; events of other groups (sliding
//! window, ...) and of unknown types are counted and skipped. A state whose
//! `state_position` is not on a block boundary is skipped too (libmarconi
//! never publishes one; a router that needs them must check the tail tokens,
//! §4): the index then under-reports that engine, never over-reports.

use rmp::Marker;

use crate::index::{BlockHash, IndexEvent};

/// Nesting deeper than this is refused (the schema needs 4 levels).
const MAX_DEPTH: u32 = 32;

/// Why a payload could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes end inside a value.
    #[error("payload truncated at byte {0}")]
    Truncated(usize),
    /// A value of the wrong type.
    #[error("byte {at}: expected {expected}")]
    Unexpected {
        /// Offset of the value.
        at: usize,
        /// What the schema wants there.
        expected: &'static str,
    },
    /// Nesting beyond what the schema needs.
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    /// Bytes after the batch.
    #[error("{0} bytes after the batch")]
    Trailing(usize),
}

/// What each group id holds, learned from `kv_cache_spec_kind` (keep one
/// per engine: removals carry only the group id).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Groups {
    kinds: Vec<(i64, GroupKind)>,
}

/// What a group's blocks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Attention KV (indexed as blocks).
    Kv,
    /// Recurrent states (indexed as states at block ends).
    State,
    /// Anything else (skipped).
    Other,
}

impl Groups {
    fn kind(&self, group: i64) -> GroupKind {
        match self.kinds.iter().find(|(g, _)| *g == group) {
            Some(&(_, k)) => k,
            None if group == 0 => GroupKind::Kv,
            None if group == 1 => GroupKind::State,
            None => GroupKind::Other,
        }
    }

    fn learn(&mut self, group: i64, spec_kind: &str) {
        let k = match spec_kind {
            "full_attention" => GroupKind::Kv,
            "mamba" => GroupKind::State,
            _ => GroupKind::Other,
        };
        if let Some(slot) = self.kinds.iter_mut().find(|(g, _)| *g == group) {
            slot.1 = k;
        } else if self.kinds.len() < 64 {
            self.kinds.push((group, k));
        }
    }
}

/// One decoded batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// `ts`, seconds.
    pub ts: f64,
    /// `data_parallel_rank`, when present.
    pub data_parallel_rank: Option<i64>,
    /// The events the index applies, in order.
    pub events: Vec<IndexEvent>,
    /// Events skipped (other groups, unknown types, unaligned states).
    pub skipped: u32,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

type R<T> = Result<T, DecodeError>;

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(DecodeError::Truncated(self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> R<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |a, &b| (a << 8) | u64::from(b)))
    }

    fn peek(&self) -> R<Marker> {
        self.buf
            .get(self.pos)
            .map(|&b| Marker::from_u8(b))
            .ok_or(DecodeError::Truncated(self.pos))
    }

    fn marker(&mut self) -> R<Marker> {
        let m = self.peek()?;
        self.pos += 1;
        Ok(m)
    }

    fn unexpected<T>(&self, at: usize, expected: &'static str) -> R<T> {
        Err(DecodeError::Unexpected { at, expected })
    }

    /// A length, checked to be possible with the bytes left (each item
    /// takes at least one byte).
    fn len_ok(&self, n: u64) -> R<usize> {
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(DecodeError::Truncated(self.pos));
        }
        Ok(n as usize)
    }

    fn is_nil(&mut self) -> R<bool> {
        if self.peek()? == Marker::Null {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn int(&mut self) -> R<i128> {
        let at = self.pos;
        Ok(match self.marker()? {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be(1)?),
            Marker::U16 => i128::from(self.be(2)?),
            Marker::U32 => i128::from(self.be(4)?),
            Marker::U64 => i128::from(self.be(8)?),
            Marker::I8 => i128::from(self.be(1)? as u8 as i8),
            Marker::I16 => i128::from(self.be(2)? as u16 as i16),
            Marker::I32 => i128::from(self.be(4)? as u32 as i32),
            Marker::I64 => i128::from(self.be(8)? as i64),
            _ => return self.unexpected(at, "an integer"),
        })
    }

    fn small_int(&mut self, expected: &'static str) -> R<i64> {
        let at = self.pos;
        i64::try_from(self.int()?).or_else(|_| self.unexpected(at, expected))
    }

    fn float(&mut self) -> R<f64> {
        let at = self.pos;
        match self.peek()? {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            Marker::Null => self.unexpected(at, "a number"),
            _ => Ok(self.int()? as f64),
        }
    }

    fn str(&mut self) -> R<&'a str> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => self.be(1)? as usize,
            Marker::Str16 => self.be(2)? as usize,
            Marker::Str32 => self.be(4)? as usize,
            _ => return self.unexpected(at, "a string"),
        };
        std::str::from_utf8(self.take(n)?).or_else(|_| self.unexpected(at, "UTF-8"))
    }

    fn array_len(&mut self) -> R<usize> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixArray(n) => u64::from(n),
            Marker::Array16 => self.be(2)?,
            Marker::Array32 => self.be(4)?,
            _ => return self.unexpected(at, "an array"),
        };
        self.len_ok(n)
    }

    fn map_len(&mut self) -> R<usize> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixMap(n) => u64::from(n),
            Marker::Map16 => self.be(2)?,
            Marker::Map32 => self.be(4)?,
            _ => return self.unexpected(at, "a map"),
        };
        self.len_ok(n)
    }

    fn is_map(&self) -> R<bool> {
        Ok(matches!(
            self.peek()?,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32
        ))
    }

    /// A block hash: an integer (its 64 bits) or a digest (its last 8
    /// bytes, big endian).
    fn hash(&mut self) -> R<BlockHash> {
        let at = self.pos;
        let n = match self.peek()? {
            Marker::Bin8 => {
                self.pos += 1;
                self.be(1)? as usize
            }
            Marker::Bin16 => {
                self.pos += 1;
                self.be(2)? as usize
            }
            Marker::Bin32 => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => {
                let v = self.int()?;
                return if v < 0 {
                    i64::try_from(v)
                        .map(|v| v as u64)
                        .or_else(|_| self.unexpected(at, "a 64-bit block hash"))
                } else {
                    u64::try_from(v).or_else(|_| self.unexpected(at, "a 64-bit block hash"))
                };
            }
        };
        let b = self.take(n)?;
        if b.len() < 8 {
            return self.unexpected(at, "a digest of at least 8 bytes");
        }
        Ok(b[b.len() - 8..]
            .iter()
            .fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    fn hashes(&mut self) -> R<Vec<BlockHash>> {
        let n = self.array_len()?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.hash()?);
        }
        Ok(v)
    }

    fn skip(&mut self, depth: u32) -> R<()> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let m = self.marker()?;
        let (bytes, items) = match m {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                (0, 0)
            }
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (u64::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (self.be(1)?, 0),
            Marker::Str16 | Marker::Bin16 => (self.be(2)?, 0),
            Marker::Str32 | Marker::Bin32 => (self.be(4)?, 0),
            Marker::FixExt1 => (2, 0),
            Marker::FixExt2 => (3, 0),
            Marker::FixExt4 => (5, 0),
            Marker::FixExt8 => (9, 0),
            Marker::FixExt16 => (17, 0),
            Marker::Ext8 => (self.be(1)? + 1, 0),
            Marker::Ext16 => (self.be(2)? + 1, 0),
            Marker::Ext32 => (self.be(4)? + 1, 0),
            Marker::FixArray(n) => (0, u64::from(n)),
            Marker::Array16 => (0, self.be(2)?),
            Marker::Array32 => (0, self.be(4)?),
            Marker::FixMap(n) => (0, 2 * u64::from(n)),
            Marker::Map16 => (0, 2 * self.be(2)?),
            Marker::Map32 => (0, 2 * self.be(4)?),
            Marker::Reserved => return self.unexpected(self.pos - 1, "a msgpack value"),
        };
        let bytes = self.len_ok(bytes)?;
        self.take(bytes)?;
        for _ in 0..self.len_ok(items)? {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

/// The fields of a `BlockStored` / `BlockRemoved` the index needs.
#[derive(Default)]
struct Fields {
    block_hashes: Vec<BlockHash>,
    block_size: Option<i64>,
    group_idx: Option<i64>,
    spec_kind: Option<String>,
    state_position: Option<i64>,
}

/// Field order of the legacy array layout, after the tag.
const STORED_FIELDS: [&str; 12] = [
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
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn field(r: &mut Reader<'_>, f: &mut Fields, name: &str, depth: u32) -> R<()> {
    match name {
        "block_hashes" => f.block_hashes = r.hashes()?,
        "block_size" if !r.is_nil()? => f.block_size = Some(r.small_int("a block size")?),
        "group_idx" if !r.is_nil()? => f.group_idx = Some(r.small_int("a group index")?),
        "state_position" if !r.is_nil()? => {
            f.state_position = Some(r.small_int("a state position")?)
        }
        "kv_cache_spec_kind" if !r.is_nil()? => f.spec_kind = Some(r.str()?.to_owned()),
        "block_size" | "group_idx" | "state_position" | "kv_cache_spec_kind" => {}
        _ => r.skip(depth)?,
    }
    Ok(())
}

fn event(r: &mut Reader<'_>, groups: &mut Groups, out: &mut Batch) -> R<()> {
    let mut f = Fields::default();
    let tag;
    if r.is_map()? {
        let n = r.map_len()?;
        let mut t = None;
        for _ in 0..n {
            let key = r.str()?;
            if key == "type" {
                t = Some(r.str()?);
            } else {
                // The tag comes first (msgspec writes it first); fields
                // before it are read by name all the same.
                field(r, &mut f, key, 3)?;
            }
        }
        let at = r.pos;
        tag = t.map_or_else(|| r.unexpected(at, "a \"type\" key"), Ok)?;
    } else {
        let n = r.array_len()?;
        if n == 0 {
            return r.unexpected(r.pos, "a tagged event");
        }
        tag = r.str()?;
        let names: &[&str] = match tag {
            "BlockStored" => &STORED_FIELDS,
            "BlockRemoved" => &REMOVED_FIELDS,
            _ => &[],
        };
        for i in 0..n - 1 {
            match names.get(i) {
                Some(name) => field(r, &mut f, name, 3)?,
                None => r.skip(3)?,
            }
        }
    }
    let group = f.group_idx.unwrap_or(0);
    match tag {
        "BlockStored" => {
            if let Some(k) = &f.spec_kind {
                groups.learn(group, k);
            }
            let at = r.pos;
            let bs = f
                .block_size
                .and_then(|b| u32::try_from(b).ok())
                .map_or_else(|| r.unexpected(at, "a block size"), Ok)?;
            match groups.kind(group) {
                GroupKind::Kv => out.events.push(IndexEvent::BlocksStored {
                    block_hashes: f.block_hashes,
                    block_size: bs,
                }),
                GroupKind::State
                    if f.state_position
                        .is_none_or(|p| bs > 0 && p > 0 && p % i64::from(bs) == 0) =>
                {
                    out.events.extend(
                        f.block_hashes
                            .into_iter()
                            .map(|block_hash| IndexEvent::StateStored { block_hash }),
                    )
                }
                GroupKind::State | GroupKind::Other => out.skipped += 1,
            }
        }
        "BlockRemoved" => match groups.kind(group) {
            GroupKind::Kv => out.events.push(IndexEvent::BlocksRemoved {
                block_hashes: f.block_hashes,
            }),
            GroupKind::State => out.events.extend(
                f.block_hashes
                    .into_iter()
                    .map(|block_hash| IndexEvent::StateRemoved { block_hash }),
            ),
            GroupKind::Other => out.skipped += 1,
        },
        "AllBlocksCleared" => out.events.push(IndexEvent::AllCleared),
        _ => out.skipped += 1,
    }
    Ok(())
}

fn events(r: &mut Reader<'_>, groups: &mut Groups, out: &mut Batch) -> R<()> {
    let n = r.array_len()?;
    out.events.reserve(n);
    for _ in 0..n {
        event(r, groups, out)?;
    }
    Ok(())
}

/// Decodes one payload; `groups` is the publishing engine's group table
/// (updated from its store events).
pub fn decode_batch(payload: &[u8], groups: &mut Groups) -> Result<Batch, DecodeError> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let mut out = Batch::default();
    if r.is_map()? {
        let n = r.map_len()?;
        let mut seen_events = false;
        for _ in 0..n {
            match r.str()? {
                "ts" => out.ts = r.float()?,
                "events" => {
                    events(&mut r, groups, &mut out)?;
                    seen_events = true;
                }
                "data_parallel_rank" if !r.is_nil()? => {
                    out.data_parallel_rank = Some(r.small_int("a rank")?)
                }
                "data_parallel_rank" => {}
                _ => r.skip(1)?,
            }
        }
        if !seen_events {
            return r.unexpected(0, "an \"events\" key");
        }
    } else {
        let n = r.array_len()?;
        if n < 2 {
            return r.unexpected(0, "[ts, events, ...]");
        }
        out.ts = r.float()?;
        events(&mut r, groups, &mut out)?;
        if n >= 3 && !r.is_nil()? {
            out.data_parallel_rank = Some(r.small_int("a rank")?);
        }
        for _ in 3..n {
            r.skip(1)?;
        }
    }
    if r.pos != payload.len() {
        return Err(DecodeError::Trailing(payload.len() - r.pos));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn text(b: &mut Vec<u8>, s: &str) {
        assert!(s.len() < 32);
        b.push(0xa0 | s.len() as u8);
        b.extend_from_slice(s.as_bytes());
    }

    /// docs/events.md §3's example batch, byte for byte.
    fn example() -> Vec<u8> {
        let mut b = hex("93 cb3ff8000000000000 93 8a");
        for (k, v) in [("type", "BlockStored"), ("block_hashes", "")] {
            text(&mut b, k);
            if !v.is_empty() {
                text(&mut b, v);
            }
        }
        b.extend(hex("91 01"));
        text(&mut b, "parent_block_hash");
        b.push(0xc0);
        text(&mut b, "token_ids");
        b.extend(hex("94 01020304"));
        text(&mut b, "block_size");
        b.push(4);
        text(&mut b, "lora_id");
        b.push(0xc0);
        text(&mut b, "medium");
        text(&mut b, "GPU");
        text(&mut b, "lora_name");
        b.push(0xc0);
        text(&mut b, "group_idx");
        b.push(0);
        text(&mut b, "kv_cache_spec_kind");
        text(&mut b, "full_attention");
        b.push(0x84);
        text(&mut b, "type");
        text(&mut b, "BlockRemoved");
        text(&mut b, "block_hashes");
        b.extend(hex("91 01"));
        text(&mut b, "medium");
        text(&mut b, "GPU");
        text(&mut b, "group_idx");
        b.push(0);
        b.push(0x81);
        text(&mut b, "type");
        text(&mut b, "AllBlocksCleared");
        b.push(0);
        b
    }

    #[test]
    fn the_documented_example() {
        let b = decode_batch(&example(), &mut Groups::default()).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, Some(0));
        assert_eq!(
            b.events,
            vec![
                IndexEvent::BlocksStored {
                    block_hashes: vec![1],
                    block_size: 4
                },
                IndexEvent::BlocksRemoved {
                    block_hashes: vec![1]
                },
                IndexEvent::AllCleared,
            ]
        );
    }

    #[test]
    fn legacy_arrays_states_and_digests() {
        // [ts, [stored (array layout, digest hash), state (group 1, map)], nil]
        let mut b = hex("93 cb3ff0000000000000 92");
        b.push(0x9d); // 13 elements: tag + 12 fields
        text(&mut b, "BlockStored");
        b.extend(hex("91 c420"));
        b.extend((0u8..32).collect::<Vec<_>>());
        b.extend(hex("c0 94 01020304 04 c0"));
        text(&mut b, "GPU");
        b.extend(hex("c0 c0 00"));
        text(&mut b, "full_attention");
        b.extend(hex("c0 c0"));
        b.push(0x85);
        text(&mut b, "type");
        text(&mut b, "BlockStored");
        text(&mut b, "block_hashes");
        b.extend(hex("91 cf 18191a1b1c1d1e1f"));
        text(&mut b, "block_size");
        b.push(4);
        text(&mut b, "group_idx");
        b.push(1);
        text(&mut b, "state_position");
        b.push(4);
        b.push(0xc0);
        let got = decode_batch(&b, &mut Groups::default()).unwrap();
        let h = 0x18191a1b1c1d1e1f;
        assert_eq!(
            got.events,
            vec![
                IndexEvent::BlocksStored {
                    block_hashes: vec![h],
                    block_size: 4
                },
                IndexEvent::StateStored { block_hash: h },
            ]
        );
        assert_eq!(got.data_parallel_rank, None);
    }

    fn stored(b: &mut Vec<u8>, tag: &str, group: u8, pos: u8) {
        b.push(0x85);
        text(b, "type");
        text(b, tag);
        text(b, "block_hashes");
        b.extend(hex("91 05"));
        text(b, "block_size");
        b.push(4);
        text(b, "group_idx");
        b.push(group);
        text(b, "state_position");
        b.push(pos);
    }

    #[test]
    fn other_groups_unknown_types_and_unaligned_states_are_skipped() {
        let mut g = Groups::default();
        g.learn(2, "sliding_window");
        let mut b = hex("92 00 94");
        stored(&mut b, "BlockStored", 2, 4);
        stored(&mut b, "BlockStored", 1, 3);
        stored(&mut b, "SomethingNew", 0, 4);
        stored(&mut b, "BlockStored", 1, 4);
        let got = decode_batch(&b, &mut g).unwrap();
        assert_eq!(got.skipped, 3);
        assert_eq!(got.events, vec![IndexEvent::StateStored { block_hash: 5 }]);
        // A group announced as mamba holds states whatever its number.
        g.learn(7, "mamba");
        let mut b = hex("92 00 91");
        stored(&mut b, "BlockStored", 7, 8);
        let got = decode_batch(&b, &mut g).unwrap();
        assert_eq!(got.events, vec![IndexEvent::StateStored { block_hash: 5 }]);
    }

    #[test]
    fn malformed_payloads_are_errors() {
        let good = example();
        for cut in 0..good.len() {
            assert!(decode_batch(&good[..cut], &mut Groups::default()).is_err());
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            decode_batch(&long, &mut Groups::default()),
            Err(DecodeError::Trailing(1))
        );
        // An array claiming 2^32-1 items in a few bytes.
        assert!(matches!(
            decode_batch(&hex("93 00 dd ffffffff"), &mut Groups::default()),
            Err(DecodeError::Truncated(_))
        ));
        // Deep nesting in an unknown field.
        let mut deep = hex("92 00 91 82");
        text(&mut deep, "type");
        text(&mut deep, "AllBlocksCleared");
        text(&mut deep, "x");
        deep.extend(std::iter::repeat_n(0x91, 100));
        deep.push(0);
        assert_eq!(
            decode_batch(&deep, &mut Groups::default()),
            Err(DecodeError::TooDeep)
        );
        for junk in [&[0xc1u8][..], &[0x92, 0xc0, 0x90], &[0x91, 0x00]] {
            assert!(decode_batch(junk, &mut Groups::default()).is_err());
        }
    }
}
