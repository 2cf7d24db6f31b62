//! vLLM's chained block hashes with `sha256_cbor` (docs/events.md §2):
//! `hash(block) = SHA-256(CBOR([parent, tokens, extra_keys]))`, the parent of
//! block 0 being `NONE_HASH = SHA-256(CBOR(seed))`.

use sha2::{Digest, Sha256};

/// A full block digest (what chaining uses).
pub type Digest32 = [u8; 32];

/// vLLM's default seed for `NONE_HASH` with SHA-256 algorithms (used when
/// `PYTHONHASHSEED` is not set).
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// How a cache namespace `n != 0` enters the block hashes and the events'
/// extra keys (docs/events.md §2). Namespace 0 has no extra keys in every
/// mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Namespaces {
    /// As vLLM hashes a request with `cache_salt = str(n)`: the first block
    /// of a chain has the extra keys `(("cache_salt", "n"),)`, the others
    /// none; events publish `["n"]` for that block (vLLM's untagged form).
    #[default]
    CacheSalt,
    /// As vLLM hashes a request with the LoRA adapter named `str(n)` and an
    /// empty path: every block has `(("lora", "n", ""),)`; events publish
    /// `["n"]` per block and `lora_name` `"n"`.
    Lora,
    /// libmarconi's earlier form: every block has the extra keys `[n]` (an
    /// integer), published as is. No vLLM emits it, so no router maps it.
    ExtraKeys,
}

/// Computes block digests for one seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    none_hash: Digest32,
    namespaces: Namespaces,
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self::new(DEFAULT_SEED)
    }
}

impl BlockHasher {
    /// A hasher whose chains start at `NONE_HASH = SHA-256(CBOR(seed))`.
    pub fn new(seed: &str) -> Self {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        cbor_head(&mut buf, 3, seed.len() as u64);
        buf.extend_from_slice(seed.as_bytes());
        BlockHasher {
            none_hash: Sha256::digest(&buf).into(),
            namespaces: Namespaces::default(),
        }
    }

    /// This hasher with namespaces hashed as `namespaces` says.
    pub fn with_namespaces(mut self, namespaces: Namespaces) -> Self {
        self.namespaces = namespaces;
        self
    }

    /// How namespaces are hashed.
    pub fn namespaces(&self) -> Namespaces {
        self.namespaces
    }

    /// The parent of block 0.
    pub fn none_hash(&self) -> &Digest32 {
        &self.none_hash
    }

    /// The digest of a block of `tokens` after `parent` (`None`: the first
    /// block of a chain), with the extra keys of namespace `ns` (none when
    /// `ns` is 0; see [`Namespaces`]).
    pub fn hash_block(&self, parent: Option<&Digest32>, tokens: &[u32], ns: u64) -> Digest32 {
        let mut buf = Vec::with_capacity(40 + tokens.len() * 5);
        let extra = match (ns, self.namespaces) {
            (0, _) => Extra::None,
            (_, Namespaces::CacheSalt) if parent.is_some() => Extra::None,
            (n, Namespaces::CacheSalt) => Extra::Salt(n),
            (n, Namespaces::Lora) => Extra::Lora(n),
            (n, Namespaces::ExtraKeys) => Extra::Int(n),
        };
        cbor_block(&mut buf, parent.unwrap_or(&self.none_hash), tokens, extra);
        Sha256::digest(&buf).into()
    }

    /// The digests of the consecutive blocks of `block_size` tokens of
    /// `tokens` (a trailing partial block is left out), from block 0.
    pub fn chain(&self, tokens: &[u32], block_size: usize, ns: u64) -> Vec<Digest32> {
        let mut out: Vec<Digest32> = Vec::with_capacity(tokens.len() / block_size.max(1));
        for block in tokens.chunks_exact(block_size.max(1)) {
            let d = self.hash_block(out.last(), block, ns);
            out.push(d);
        }
        out
    }
}

/// vLLM's integer form of a digest (`ExternalBlockHash` with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): its last 8 bytes, big endian.
pub fn external(d: &Digest32) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[24..]);
    u64::from_be_bytes(b)
}

/// CBOR major type + argument in the shortest form (RFC 8949 §3; what
/// `cbor2.dumps(canonical=True)` writes).
fn cbor_head(buf: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        buf.push(m | arg as u8);
    } else if arg <= u64::from(u8::MAX) {
        buf.push(m | 24);
        buf.push(arg as u8);
    } else if arg <= u64::from(u16::MAX) {
        buf.push(m | 25);
        buf.extend_from_slice(&(arg as u16).to_be_bytes());
    } else if arg <= u64::from(u32::MAX) {
        buf.push(m | 26);
        buf.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&arg.to_be_bytes());
    }
}

/// A block's extra keys.
#[derive(Clone, Copy, Debug)]
enum Extra {
    /// `None`.
    None,
    /// `(("cache_salt", str(n)),)`.
    Salt(u64),
    /// `(("lora", str(n), ""),)`.
    Lora(u64),
    /// `[n]`.
    Int(u64),
}

fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// `CBOR((parent, tuple(tokens), extra))` as cbor2 writes it.
fn cbor_block(buf: &mut Vec<u8>, parent: &Digest32, tokens: &[u32], extra: Extra) {
    cbor_head(buf, 4, 3);
    cbor_head(buf, 2, 32);
    buf.extend_from_slice(parent);
    cbor_head(buf, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(buf, 0, u64::from(t));
    }
    match extra {
        Extra::None => buf.push(0xf6),
        Extra::Salt(n) => {
            cbor_head(buf, 4, 1);
            cbor_head(buf, 4, 2);
            cbor_text(buf, "cache_salt");
            cbor_text(buf, &n.to_string());
        }
        Extra::Lora(n) => {
            cbor_head(buf, 4, 1);
            cbor_head(buf, 4, 3);
            cbor_text(buf, "lora");
            cbor_text(buf, &n.to_string());
            cbor_text(buf, "");
        }
        Extra::Int(n) => {
            cbor_head(buf, 4, 1);
            cbor_head(buf, 0, n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cbor_heads_are_shortest() {
        for (arg, want) in [
            (0u64, vec![0x00]),
            (23, vec![0x17]),
            (24, vec![0x18, 24]),
            (255, vec![0x18, 0xff]),
            (256, vec![0x19, 0x01, 0x00]),
            (65535, vec![0x19, 0xff, 0xff]),
            (65536, vec![0x1a, 0, 1, 0, 0]),
            (u64::from(u32::MAX), vec![0x1a, 0xff, 0xff, 0xff, 0xff]),
            (1 << 32, vec![0x1b, 0, 0, 0, 1, 0, 0, 0, 0]),
        ] {
            let mut b = Vec::new();
            cbor_head(&mut b, 0, arg);
            assert_eq!(b, want, "{arg}");
        }
    }
}
