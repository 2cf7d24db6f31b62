//! A [`ModelSpec`] read from a GGUF file's metadata (llama.cpp's model
//! format), so that an engine never types a model's dimensions by hand.
//!
//! Pure: the caller reads the bytes (the header and the metadata key/values
//! sit at the start of the file; the tensor data is never needed); this
//! module parses them. [`parse_metadata`] reads GGUF versions 2 and 3 and
//! keeps every scalar and every integer array; [`ModelSpec::from_gguf`] maps
//! the keys of the architecture named by `general.architecture` (written
//! `A` below) onto a spec.
//!
//! | `general.architecture` | layer kinds |
//! | --- | --- |
//! | `nemotron_h`, `nemotron_h_moe` | per layer: `A.attention.head_count_kv` = 0 and `A.feed_forward_length` = 0: Mamba-2; `feed_forward_length` = 0: attention; otherwise MLP (MoE when `A.expert_count` > 0) |
//! | `granitehybrid` | `head_count_kv` = 0: Mamba-2, otherwise attention; every layer also has a gated MLP (MoE when `expert_count` > 0) |
//! | `falcon-h1` | every layer runs attention and Mamba-2, then a gated MLP |
//! | `mamba2`, `mamba` | every layer Mamba-2 / Mamba-1, no attention, no MLP |
//! | `llama`, `qwen2`, `qwen3` | every layer attention + gated MLP |
//!
//! These are llama.cpp's own rules (its `load_arch_hparams` and memory layer
//! filters). The sizes are those llama.cpp stores, so that the cache's byte
//! accounting matches the engine that reads the file:
//!
//! * KV: K and V of `head_count_kv · key_length` per attention layer and token,
//!   2 bytes each (llama.cpp's default `type_k` / `type_v` is f16; a caller
//!   that sets another cache type overrides `dtype_bytes`);
//! * recurrent state, per SSM layer, in f32 (llama.cpp always keeps `r` and
//!   `s` in f32): the SSM state `ssm.state_size · ssm.inner_size` plus the
//!   conv state of `ssm.conv_kernel − 1` columns (the oldest column is
//!   shifted out at every step, so llama.cpp does not keep it) over
//!   `ssm.inner_size + 2 · ssm.group_count · ssm.state_size` channels.
//!
//! What llama.cpp's `llama_state_seq_get_size` returns on top of these
//! (cell counts, positions, per-layer type and row-size headers) is
//! measured and explained by the llama engine (`examples/llama-engine`).

use std::fmt;

use crate::model::{dims, ModelSpec};

/// The GGUF magic, "GGUF" read as a little-endian u32.
const MAGIC: [u8; 4] = *b"GGUF";

/// Integer arrays longer than this are skipped rather than kept (no
/// architecture key needs more than one value per layer).
const MAX_KEPT_ARRAY: u64 = 1 << 16;

/// Why GGUF bytes could not be read, or could not be turned into a
/// [`ModelSpec`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    /// The bytes end before the metadata does: the caller may read more of
    /// the file and try again.
    #[error("GGUF metadata is truncated at byte {0} (the file is cut short, or more of it must be read)")]
    Truncated(u64),
    /// The bytes are not GGUF, or break the format.
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    /// The architecture is not one this module maps.
    #[error("unsupported GGUF architecture {0:?} (supported: {supported})", supported = GGUF_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture(String),
    /// A key the architecture needs is absent.
    #[error("GGUF key {0:?} is missing")]
    MissingKey(String),
    /// A key has the wrong type or an impossible value.
    #[error("GGUF key {key:?}: {reason}")]
    BadKey {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Every key is well formed, but the model they describe cannot drive
    /// a cache ([`ModelSpec::validate`]'s reason).
    #[error("the model it describes is not usable: {0}")]
    Unusable(String),
}

/// The architectures [`ModelSpec::from_gguf`] maps.
pub const GGUF_ARCHITECTURES: &[&str] = &[
    "nemotron_h",
    "nemotron_h_moe",
    "granitehybrid",
    "falcon-h1",
    "mamba2",
    "mamba",
    "llama",
    "qwen2",
    "qwen3",
];

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type (u8, u16, u32, u64).
    Uint(u64),
    /// Any signed integer type (i8, i16, i32, i64).
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// A bool.
    Bool(bool),
    /// A UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// An array of integers (of any integer type), kept whole when it has at
    /// most 65,536 elements.
    IntArray(Vec<i128>),
    /// Any other array (strings, floats, bools, nested arrays, or a long
    /// integer array): its element type code and length, contents skipped.
    OtherArray {
        /// The GGUF type code of the elements.
        elem_type: u32,
        /// The number of elements.
        len: u64,
    },
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::Uint(v) => write!(f, "{v}"),
            GgufValue::Int(v) => write!(f, "{v}"),
            GgufValue::Float(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::Str(s) => write!(f, "{s:?}"),
            GgufValue::IntArray(v) => write!(f, "{v:?}"),
            GgufValue::OtherArray { elem_type, len } => {
                write!(f, "[{len} elements of type {elem_type}]")
            }
        }
    }
}

/// The header and metadata of a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufMetadata {
    /// Format version (2 or 3).
    pub version: u32,
    /// Number of tensors the file declares.
    pub tensor_count: u64,
    /// The key/value pairs, in file order.
    pub kv: Vec<(String, GgufValue)>,
    /// Bytes of the file the header and metadata take (where the tensor
    /// infos start).
    pub metadata_end: u64,
}

impl GgufMetadata {
    /// The value of `key`, if present (the first one if the file repeats it).
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        let rest = self.bytes.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n <= rest => {
                let s = &self.bytes[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(GgufError::Truncated(self.bytes.len() as u64)),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        let s = self.take(len)?;
        Ok(String::from_utf8_lossy(s).into_owned())
    }

    fn skip_string(&mut self) -> Result<(), GgufError> {
        let len = self.u64()?;
        self.take(len).map(|_| ())
    }
}

/// Byte width of a fixed-size GGUF scalar type, `None` for string and array.
fn scalar_width(t: u32) -> Option<u64> {
    match t {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn scalar(r: &mut Reader<'_>, t: u32) -> Result<GgufValue, GgufError> {
    Ok(match t {
        0 => GgufValue::Uint(u64::from(r.array::<1>()?[0])),
        1 => GgufValue::Int(i64::from(i8::from_le_bytes(r.array()?))),
        2 => GgufValue::Uint(u64::from(u16::from_le_bytes(r.array()?))),
        3 => GgufValue::Int(i64::from(i16::from_le_bytes(r.array()?))),
        4 => GgufValue::Uint(u64::from(r.u32()?)),
        5 => GgufValue::Int(i64::from(i32::from_le_bytes(r.array()?))),
        6 => GgufValue::Float(f64::from(f32::from_le_bytes(r.array()?))),
        7 => match r.array::<1>()?[0] {
            0 => GgufValue::Bool(false),
            1 => GgufValue::Bool(true),
            b => return Err(GgufError::Malformed(format!("bool value {b}"))),
        },
        8 => GgufValue::Str(r.string()?),
        10 => GgufValue::Uint(r.u64()?),
        11 => GgufValue::Int(i64::from_le_bytes(r.array()?)),
        12 => GgufValue::Float(f64::from_le_bytes(r.array()?)),
        t => return Err(GgufError::Malformed(format!("unknown value type {t}"))),
    })
}

fn value(r: &mut Reader<'_>, t: u32) -> Result<GgufValue, GgufError> {
    if t != 9 {
        return scalar(r, t);
    }
    let elem_type = r.u32()?;
    let len = r.u64()?;
    if elem_type == 9 {
        // ggml's own reader refuses nested arrays too.
        return Err(GgufError::Malformed("nested array".into()));
    }
    if elem_type == 8 {
        for _ in 0..len {
            r.skip_string()?;
        }
        return Ok(GgufValue::OtherArray { elem_type, len });
    }
    let width = scalar_width(elem_type)
        .ok_or_else(|| GgufError::Malformed(format!("unknown array element type {elem_type}")))?;
    let integer = matches!(elem_type, 0..=5 | 10 | 11);
    let Some(bytes) = len.checked_mul(width) else {
        return Err(GgufError::Malformed(format!(
            "array of {len} elements overflows"
        )));
    };
    if !integer || len > MAX_KEPT_ARRAY {
        r.take(bytes)?;
        return Ok(GgufValue::OtherArray { elem_type, len });
    }
    // The length is checked against the bytes present before anything is
    // allocated for it.
    let mut sub = Reader {
        bytes: r.take(bytes)?,
        pos: 0,
    };
    let mut out = Vec::with_capacity(len as usize);
    for _ in 0..len {
        out.push(match scalar(&mut sub, elem_type)? {
            GgufValue::Uint(v) => i128::from(v),
            GgufValue::Int(v) => i128::from(v),
            _ => unreachable!("integer element types give integers"),
        });
    }
    Ok(GgufValue::IntArray(out))
}

/// Reads the header and the metadata key/values of a GGUF file from its
/// first bytes. `bytes` may be a prefix of the file: what follows the
/// metadata (tensor infos and data) is not read. [`GgufError::Truncated`]
/// means the prefix ended inside the metadata.
pub fn parse_metadata(bytes: &[u8]) -> Result<GgufMetadata, GgufError> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>()?;
    if magic != MAGIC {
        return Err(GgufError::Malformed(format!(
            "the file does not start with \"GGUF\" (found {magic:02x?})"
        )));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Malformed(format!(
            "version {version} (this reader knows versions 2 and 3)"
        )));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    // Every pair takes at least 12 bytes (key length + type): a count the
    // bytes cannot hold is refused before anything is reserved for it.
    let mut kv = Vec::with_capacity(usize::try_from(kv_count.min(4096)).unwrap_or(0));
    for _ in 0..kv_count {
        let key = r.string()?;
        let t = r.u32()?;
        let v = value(&mut r, t)?;
        kv.push((key, v));
    }
    Ok(GgufMetadata {
        version,
        tensor_count,
        kv,
        metadata_end: r.pos as u64,
    })
}

/// Per-layer view of a key that is either one integer or one per layer.
struct Keys<'a> {
    meta: &'a GgufMetadata,
    arch: &'a str,
    n_layer: usize,
}

impl Keys<'_> {
    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn bad(&self, suffix: &str, reason: impl Into<String>) -> GgufError {
        GgufError::BadKey {
            key: self.name(suffix),
            reason: reason.into(),
        }
    }

    fn opt_u64(&self, suffix: &str) -> Result<Option<u64>, GgufError> {
        match self.meta.get(&self.name(suffix)) {
            None => Ok(None),
            Some(GgufValue::Uint(v)) => Ok(Some(*v)),
            Some(GgufValue::Int(v)) => u64::try_from(*v)
                .map(Some)
                .map_err(|_| self.bad(suffix, format!("negative value {v}"))),
            Some(v) => Err(self.bad(suffix, format!("expected an integer, found {v}"))),
        }
    }

    fn u64(&self, suffix: &str) -> Result<u64, GgufError> {
        self.opt_u64(suffix)?
            .ok_or_else(|| GgufError::MissingKey(self.name(suffix)))
    }

    /// One value per layer: an integer repeated, or an array of `n_layer`
    /// (llama.cpp also accepts a longer array: the extra entries describe
    /// appended MTP blocks and are ignored here).
    fn per_layer(&self, suffix: &str) -> Result<Option<Vec<u64>>, GgufError> {
        match self.meta.get(&self.name(suffix)) {
            None => Ok(None),
            Some(GgufValue::IntArray(a)) => {
                if a.len() < self.n_layer {
                    return Err(self.bad(
                        suffix,
                        format!("{} values for {} layers", a.len(), self.n_layer),
                    ));
                }
                a[..self.n_layer]
                    .iter()
                    .map(|&v| u64::try_from(v).map_err(|_| self.bad(suffix, format!("value {v}"))))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some)
            }
            Some(_) => Ok(self.opt_u64(suffix)?.map(|v| vec![v; self.n_layer])),
        }
    }
}

/// The layer kinds of one model, before the dimensions are filled in.
struct Layers {
    attn: Vec<usize>,
    ssm: u32,
    mlp: u32,
    moe: u32,
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The one value the given layers share, or an error naming the key: the
/// spec has one head count, one head size and one FFN width.
fn uniform(k: &Keys<'_>, suffix: &str, vals: &[u64], layers: &[usize]) -> Result<u64, GgufError> {
    let mut it = layers.iter().map(|&i| vals[i]);
    let first = it.next().unwrap_or(0);
    if it.any(|v| v != first) {
        return Err(k.bad(
            suffix,
            format!("differs between layers of one kind ({vals:?}); a ModelSpec holds one value"),
        ));
    }
    Ok(first)
}

impl ModelSpec {
    /// The spec of the model whose GGUF metadata is `bytes` (the start of
    /// the file, at least up to the end of the metadata): see the [module
    /// documentation](crate::gguf) for the architectures and how the sizes
    /// are those llama.cpp stores. The name is `general.name` when present,
    /// else the architecture.
    pub fn from_gguf(bytes: &[u8]) -> Result<ModelSpec, GgufError> {
        ModelSpec::from_gguf_metadata(&parse_metadata(bytes)?)
    }

    /// [`from_gguf`](Self::from_gguf) over already parsed metadata.
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<ModelSpec, GgufError> {
        let arch = match meta.get("general.architecture") {
            Some(GgufValue::Str(s)) => s.as_str(),
            Some(v) => {
                return Err(GgufError::BadKey {
                    key: "general.architecture".into(),
                    reason: format!("expected a string, found {v}"),
                })
            }
            None => return Err(GgufError::MissingKey("general.architecture".into())),
        };
        if !GGUF_ARCHITECTURES.contains(&arch) {
            return Err(GgufError::UnsupportedArchitecture(arch.to_owned()));
        }
        let mut k = Keys {
            meta,
            arch,
            n_layer: 0,
        };
        let n_layer = k.u64("block_count")?;
        if n_layer == 0 || n_layer > 1 << 16 {
            return Err(k.bad("block_count", format!("{n_layer} layers")));
        }
        k.n_layer = n_layer as usize;
        let n = k.n_layer;
        let d_model = k.u64("embedding_length")?;
        let recurrent_only = matches!(arch, "mamba" | "mamba2");
        let zeros = vec![0; n];
        let (heads, heads_kv, ff) = if recurrent_only {
            (zeros.clone(), zeros.clone(), zeros.clone())
        } else {
            let heads = k
                .per_layer("attention.head_count")?
                .ok_or_else(|| GgufError::MissingKey(k.name("attention.head_count")))?;
            let heads_kv = k
                .per_layer("attention.head_count_kv")?
                .unwrap_or_else(|| heads.clone());
            let ff = k.per_layer("feed_forward_length")?.unwrap_or(zeros.clone());
            (heads, heads_kv, ff)
        };
        let experts = k.opt_u64("expert_count")?.unwrap_or(0);
        let experts_used = k.opt_u64("expert_used_count")?.unwrap_or(0);
        if experts_used > experts {
            dims::experts_used(experts_used, Some(experts))
                .map_err(|r| k.bad("expert_used_count", r))?;
        }
        let all: Vec<usize> = (0..n).collect();
        let layers = match arch {
            "nemotron_h" | "nemotron_h_moe" => {
                let attn: Vec<usize> = all
                    .iter()
                    .copied()
                    .filter(|&i| heads_kv[i] != 0 && ff[i] == 0)
                    .collect();
                let ssm = all
                    .iter()
                    .filter(|&&i| heads_kv[i] == 0 && ff[i] == 0)
                    .count();
                let ffn = all.iter().filter(|&&i| ff[i] != 0).count();
                let (mlp, moe) = if experts > 0 { (0, ffn) } else { (ffn, 0) };
                Layers {
                    attn,
                    ssm: count(ssm),
                    mlp: count(mlp),
                    moe: count(moe),
                }
            }
            "granitehybrid" => {
                let attn: Vec<usize> = all.iter().copied().filter(|&i| heads_kv[i] != 0).collect();
                let ssm = n - attn.len();
                let (mlp, moe) = if experts > 0 { (0, n) } else { (n, 0) };
                Layers {
                    attn,
                    ssm: count(ssm),
                    mlp: count(mlp),
                    moe: count(moe),
                }
            }
            "falcon-h1" => Layers {
                attn: all.clone(),
                ssm: count(n),
                mlp: count(n),
                moe: 0,
            },
            "mamba" | "mamba2" => Layers {
                attn: Vec::new(),
                ssm: count(n),
                mlp: 0,
                moe: 0,
            },
            _ => Layers {
                attn: all.clone(),
                ssm: 0,
                mlp: count(n),
                moe: 0,
            },
        };
        if layers.moe > 0 {
            dims::experts_used(experts_used, Some(experts))
                .map_err(|r| k.bad("expert_used_count", r))?;
        }
        let n_heads = uniform(&k, "attention.head_count", &heads, &layers.attn)?;
        let kv_heads = uniform(&k, "attention.head_count_kv", &heads_kv, &layers.attn)?;
        let ffn_layers: Vec<usize> = all.iter().copied().filter(|&i| ff[i] != 0).collect();
        let ffn_dim = uniform(&k, "feed_forward_length", &ff, &ffn_layers)?;
        let head_dim = if layers.attn.is_empty() {
            0
        } else {
            match k.opt_u64("attention.key_length")? {
                Some(v) => v,
                None if n_heads > 0 => d_model / n_heads,
                None => return Err(k.bad("attention.head_count", "0 heads in an attention layer")),
            }
        };
        if let Some(v) = k.opt_u64("attention.value_length")? {
            if !layers.attn.is_empty() && v != head_dim {
                return Err(k.bad(
                    "attention.value_length",
                    format!(
                        "{v} differs from key_length {head_dim}; a ModelSpec has one head size"
                    ),
                ));
            }
        }
        let (ssm_inner, d_state, conv_channels, conv_kernel) = if layers.ssm == 0 {
            (0, 0, 0, 0)
        } else {
            let inner = k.u64("ssm.inner_size")?;
            let state = k.u64("ssm.state_size")?;
            let conv = dims::conv_width(k.u64("ssm.conv_kernel")?)
                .map_err(|r| k.bad("ssm.conv_kernel", r))?;
            // Mamba-1 has no groups; every Mamba-2 mixer has at least one
            // (llama.cpp requires the key).
            let groups = if arch == "mamba" {
                0
            } else {
                dims::groups(k.u64("ssm.group_count")?).map_err(|r| k.bad("ssm.group_count", r))?
            };
            let channels = groups
                .checked_mul(2)
                .and_then(|g| g.checked_mul(state))
                .and_then(|g| g.checked_add(inner))
                .ok_or_else(|| k.bad("ssm.group_count", "conv channels overflow 64 bits"))?;
            (inner, state, channels, conv - 1)
        };
        let name = match meta.get("general.name") {
            Some(GgufValue::Str(s)) if !s.is_empty() => s.clone(),
            _ => arch.to_owned(),
        };
        let spec = ModelSpec {
            name,
            attn_layers: count(layers.attn.len()),
            ssm_layers: layers.ssm,
            mlp_layers: layers.mlp,
            moe_layers: layers.moe,
            moe_top_k: if layers.moe > 0 {
                u32::try_from(experts_used).unwrap_or(u32::MAX)
            } else {
                0
            },
            d_model,
            n_heads,
            kv_heads,
            head_dim,
            ffn_dim,
            // nemotron_h's MLP is up + down with squared ReLU; the others gate.
            ffn_matrices: if arch.starts_with("nemotron_h") { 2 } else { 3 },
            ssm_inner,
            d_state,
            ssm_state_channels: ssm_inner,
            conv_channels,
            conv_kernel,
            dtype_bytes: 2,
            state_dtype_bytes: 4,
        };
        spec.validate().map_err(GgufError::Unusable)?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF writer for the tests (llama.cpp's and PyPI gguf's
    /// writers are checked against this reader by the llama engine).
    #[derive(Default)]
    struct W(Vec<u8>);

    impl W {
        fn header(version: u32, tensors: u64, kvs: u64) -> W {
            let mut w = W::default();
            w.0.extend_from_slice(b"GGUF");
            w.0.extend_from_slice(&version.to_le_bytes());
            w.0.extend_from_slice(&tensors.to_le_bytes());
            w.0.extend_from_slice(&kvs.to_le_bytes());
            w
        }
        fn str(&mut self, s: &str) {
            self.0.extend_from_slice(&(s.len() as u64).to_le_bytes());
            self.0.extend_from_slice(s.as_bytes());
        }
        fn key(&mut self, k: &str, t: u32) {
            self.str(k);
            self.0.extend_from_slice(&t.to_le_bytes());
        }
        fn kv_u32(&mut self, k: &str, v: u32) {
            self.key(k, 4);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
        fn kv_str(&mut self, k: &str, v: &str) {
            self.key(k, 8);
            self.str(v);
        }
        fn kv_i32s(&mut self, k: &str, v: &[i32]) {
            self.key(k, 9);
            self.0.extend_from_slice(&5u32.to_le_bytes());
            self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                self.0.extend_from_slice(&x.to_le_bytes());
            }
        }
        fn kv_strs(&mut self, k: &str, v: &[&str]) {
            self.key(k, 9);
            self.0.extend_from_slice(&8u32.to_le_bytes());
            self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                self.str(s);
            }
        }
    }

    /// A Nemotron-H: layers M * - M - M (3 Mamba-2, 1 attention, 2 MLP).
    fn nemotron() -> Vec<u8> {
        let mut w = W::header(3, 0, 14);
        w.kv_str("general.architecture", "nemotron_h");
        w.kv_str("general.name", "tiny-nemotron");
        w.kv_strs("tokenizer.ggml.tokens", &["a", "b", "c"]);
        w.kv_u32("nemotron_h.block_count", 6);
        w.kv_u32("nemotron_h.embedding_length", 256);
        w.kv_i32s("nemotron_h.attention.head_count", &[0, 4, 0, 0, 0, 0]);
        w.kv_i32s("nemotron_h.attention.head_count_kv", &[0, 2, 0, 0, 0, 0]);
        w.kv_i32s("nemotron_h.feed_forward_length", &[0, 0, 512, 0, 512, 0]);
        w.kv_u32("nemotron_h.ssm.conv_kernel", 4);
        w.kv_u32("nemotron_h.ssm.inner_size", 512);
        w.kv_u32("nemotron_h.ssm.state_size", 64);
        w.kv_u32("nemotron_h.ssm.time_step_rank", 8);
        w.kv_u32("nemotron_h.ssm.group_count", 2);
        w.kv_u32("nemotron_h.context_length", 4096);
        w.0
    }

    /// The Nemotron-H of [`nemotron`] with u32 keys (without the
    /// architecture prefix) replaced or added and per-layer arrays replaced.
    fn nemotron_with(u32s: &[(&str, u32)], arrays: &[(&str, [i32; 6])]) -> Vec<u8> {
        let mut keys: Vec<(String, u32)> = [
            ("block_count", 6),
            ("embedding_length", 256),
            ("ssm.conv_kernel", 4),
            ("ssm.inner_size", 512),
            ("ssm.state_size", 64),
            ("ssm.group_count", 2),
        ]
        .iter()
        .map(|&(k, v)| (k.to_owned(), v))
        .collect();
        for &(k, v) in u32s {
            keys.retain(|(old, _)| old != k);
            keys.push((k.to_owned(), v));
        }
        let mut lists: Vec<(&str, [i32; 6])> = vec![
            ("attention.head_count", [0, 4, 0, 0, 0, 0]),
            ("attention.head_count_kv", [0, 2, 0, 0, 0, 0]),
            ("feed_forward_length", [0, 0, 512, 0, 512, 0]),
        ];
        for &(k, v) in arrays {
            lists.retain(|(old, _)| *old != k);
            lists.push((k, v));
        }
        let mut w = W::header(3, 0, (1 + keys.len() + lists.len()) as u64);
        w.kv_str("general.architecture", "nemotron_h");
        for (k, v) in &keys {
            w.kv_u32(&format!("nemotron_h.{k}"), *v);
        }
        for (k, v) in &lists {
            w.kv_i32s(&format!("nemotron_h.{k}"), v);
        }
        w.0
    }

    #[test]
    fn impossible_models_are_refused_naming_the_key() {
        assert!(ModelSpec::from_gguf(&nemotron_with(&[], &[])).is_ok());
        let moe = [("expert_count", 4), ("expert_used_count", 2)];
        assert_eq!(
            ModelSpec::from_gguf(&nemotron_with(&moe, &[])).map(|m| (m.moe_layers, m.moe_top_k)),
            Ok((2, 2))
        );
        let bad_key = |key: &'static str| move |e: &GgufError| matches!(e, GgufError::BadKey { key: k, .. } if *k == format!("nemotron_h.{key}"));
        type Check = Box<dyn Fn(&GgufError) -> bool>;
        let cases: Vec<(Vec<u8>, Check)> = vec![
            (
                nemotron_with(&[("ssm.group_count", 0)], &[]),
                Box::new(bad_key("ssm.group_count")),
            ),
            (
                nemotron_with(&[("ssm.conv_kernel", 0)], &[]),
                Box::new(bad_key("ssm.conv_kernel")),
            ),
            (
                nemotron_with(&[("expert_count", 4), ("expert_used_count", 8)], &[]),
                Box::new(bad_key("expert_used_count")),
            ),
            (
                nemotron_with(&[("expert_count", 4), ("expert_used_count", 0)], &[]),
                Box::new(bad_key("expert_used_count")),
            ),
            (
                nemotron_with(&[], &[("attention.head_count_kv", [0, 8, 0, 0, 0, 0])]),
                Box::new(
                    |e: &GgufError| matches!(e, GgufError::Unusable(r) if r.contains("KV heads")),
                ),
            ),
            // Well formed, but no model: the spec's validation refuses it.
            (
                nemotron_with(&[("embedding_length", 0)], &[]),
                Box::new(|e: &GgufError| matches!(e, GgufError::Unusable(_))),
            ),
        ];
        for (i, (bytes, want)) in cases.iter().enumerate() {
            let e = ModelSpec::from_gguf(bytes).expect_err(&format!("case {i}"));
            assert!(want(&e), "case {i}: {e:?}");
        }
        let mut w = W::header(3, 0, 7);
        w.kv_str("general.architecture", "mamba2");
        for (k, v) in [
            ("block_count", 2),
            ("embedding_length", 64),
            ("ssm.conv_kernel", 4),
            ("ssm.inner_size", 128),
            ("ssm.state_size", 16),
            ("ssm.time_step_rank", 4),
        ] {
            w.kv_u32(&format!("mamba2.{k}"), v);
        }
        assert_eq!(
            ModelSpec::from_gguf(&w.0),
            Err(GgufError::MissingKey("mamba2.ssm.group_count".into()))
        );
    }

    #[test]
    fn nemotron_h_layers_and_sizes() {
        let bytes = nemotron();
        let meta = parse_metadata(&bytes).unwrap();
        assert_eq!(meta.version, 3);
        assert_eq!(meta.metadata_end, bytes.len() as u64);
        assert_eq!(
            meta.get("tokenizer.ggml.tokens"),
            Some(&GgufValue::OtherArray {
                elem_type: 8,
                len: 3
            })
        );
        let m = ModelSpec::from_gguf(&bytes).unwrap();
        assert_eq!(m.name, "tiny-nemotron");
        assert_eq!(
            (m.attn_layers, m.ssm_layers, m.mlp_layers, m.moe_layers),
            (1, 3, 2, 0)
        );
        assert_eq!((m.n_heads, m.kv_heads, m.head_dim), (4, 2, 64));
        assert_eq!((m.ffn_dim, m.ffn_matrices), (512, 2));
        // K and V: 2 heads · 64 · 2 bytes each, one attention layer.
        assert_eq!(m.kv_bytes_per_token(), 2 * 2 * 64 * 2);
        // f32: SSM 512 · 64, conv (512 + 2·2·64) channels · 3 columns.
        assert_eq!(m.state_bytes_per_layer(), (512 * 64 + (512 + 256) * 3) * 4);
        assert_eq!(m.state_bytes(), 3 * m.state_bytes_per_layer());
    }

    #[test]
    fn a_prefix_of_the_metadata_is_truncated_at_every_cut() {
        let bytes = nemotron();
        for cut in 0..bytes.len() {
            match parse_metadata(&bytes[..cut]) {
                Err(GgufError::Truncated(_)) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        // Bytes after the metadata (tensor infos, data) are not read.
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0xff; 100]);
        assert_eq!(ModelSpec::from_gguf(&longer), ModelSpec::from_gguf(&bytes));
    }

    #[test]
    fn bad_files_give_errors_not_panics() {
        assert!(matches!(
            parse_metadata(b"GGML\x03\0\0\0"),
            Err(GgufError::Malformed(_))
        ));
        let mut w = W::header(1, 0, 0);
        assert!(matches!(parse_metadata(&w.0), Err(GgufError::Malformed(_))));
        // A string or array length far beyond the bytes: truncated, nothing
        // allocated for it.
        w = W::header(3, 0, 1);
        w.0.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse_metadata(&w.0), Err(GgufError::Truncated(_))));
        w = W::header(3, 0, 1);
        w.key("a", 9);
        w.0.extend_from_slice(&4u32.to_le_bytes());
        w.0.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(matches!(
            parse_metadata(&w.0),
            Err(GgufError::Malformed(_) | GgufError::Truncated(_))
        ));
        // Unknown type, nested array, bad bool.
        for (t, extra) in [
            (13u32, vec![]),
            (9, [9u32.to_le_bytes(), [0; 4]].concat()),
            (7, vec![2]),
        ] {
            let mut w = W::header(3, 0, 1);
            w.key("k", t);
            w.0.extend_from_slice(&extra);
            w.0.extend_from_slice(&[0; 16]);
            assert!(
                matches!(parse_metadata(&w.0), Err(GgufError::Malformed(_))),
                "type {t}"
            );
        }
        // A kv count in the billions with no bytes behind it.
        let w = W::header(3, 0, u64::MAX);
        assert!(matches!(parse_metadata(&w.0), Err(GgufError::Truncated(_))));
    }

    #[test]
    fn mapping_errors_name_the_key() {
        let mut w = W::header(3, 0, 1);
        w.kv_str("general.architecture", "rwkv7");
        assert!(matches!(
            ModelSpec::from_gguf(&w.0),
            Err(GgufError::UnsupportedArchitecture(a)) if a == "rwkv7"
        ));
        let mut w = W::header(3, 0, 2);
        w.kv_str("general.architecture", "mamba2");
        w.kv_u32("mamba2.block_count", 4);
        assert_eq!(
            ModelSpec::from_gguf(&w.0),
            Err(GgufError::MissingKey("mamba2.embedding_length".into()))
        );
        let mut w = W::header(3, 0, 4);
        w.kv_str("general.architecture", "llama");
        w.kv_u32("llama.block_count", 3);
        w.kv_u32("llama.embedding_length", 64);
        w.kv_i32s("llama.attention.head_count", &[4, 4]);
        let e = ModelSpec::from_gguf(&w.0).unwrap_err().to_string();
        assert!(
            e.contains("llama.attention.head_count") && e.contains("2 values for 3 layers"),
            "{e}"
        );
        let mut w = W::header(3, 0, 4);
        w.kv_str("general.architecture", "llama");
        w.kv_u32("llama.block_count", 2);
        w.kv_u32("llama.embedding_length", 64);
        w.kv_i32s("llama.attention.head_count", &[4, 8]);
        let e = ModelSpec::from_gguf(&w.0).unwrap_err().to_string();
        assert!(e.contains("differs between layers"), "{e}");
    }

    #[test]
    fn mamba_and_dense_models() {
        let mut w = W::header(2, 0, 6);
        w.kv_str("general.architecture", "mamba");
        w.kv_u32("mamba.block_count", 4);
        w.kv_u32("mamba.embedding_length", 128);
        w.kv_u32("mamba.ssm.conv_kernel", 4);
        w.kv_u32("mamba.ssm.inner_size", 256);
        w.kv_u32("mamba.ssm.state_size", 16);
        let m = ModelSpec::from_gguf(&w.0).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers, m.mlp_layers), (0, 4, 0));
        assert_eq!(m.state_bytes_per_layer(), (256 * 16 + 256 * 3) * 4);
        assert_eq!(m.kv_bytes_per_token(), 0);
        let mut w = W::header(3, 0, 6);
        w.kv_str("general.architecture", "qwen2");
        w.kv_u32("qwen2.block_count", 2);
        w.kv_u32("qwen2.embedding_length", 64);
        w.kv_u32("qwen2.attention.head_count", 4);
        w.kv_u32("qwen2.attention.head_count_kv", 2);
        w.kv_u32("qwen2.feed_forward_length", 128);
        let m = ModelSpec::from_gguf(&w.0).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers, m.mlp_layers), (2, 0, 2));
        assert_eq!(m.kv_bytes_per_token(), 2 * (2 * 2 * 16 * 2));
        assert_eq!(m.state_bytes(), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Any bytes after the magic: an error or a spec that validates,
        /// never a panic (overflow checks are on in the test builds).
        #[test]
        fn arbitrary_bytes_never_panic(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let mut b = b"GGUF\x03\0\0\0".to_vec();
            b.extend_from_slice(&tail);
            if let Ok(m) = ModelSpec::from_gguf(&b) {
                proptest::prop_assert!(m.validate().is_ok());
            }
        }

        /// A real file with bytes overwritten (lengths, counts, type codes,
        /// values set to extremes): an error or a valid spec, never a panic.
        #[test]
        fn corrupted_files_never_panic(
            edits in proptest::collection::vec((0usize..2000, proptest::prop_oneof![
                proptest::strategy::Just(0u8),
                proptest::strategy::Just(0xffu8),
                proptest::prelude::any::<u8>(),
            ]), 1..6),
        ) {
            let mut b = nemotron();
            for (at, v) in edits {
                let at = at % b.len();
                b[at] = v;
            }
            if let Ok(m) = ModelSpec::from_gguf(&b) {
                proptest::prop_assert!(m.validate().is_ok());
            }
        }
    }
}
