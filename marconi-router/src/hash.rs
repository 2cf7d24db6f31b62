//! The chained block hashes of `docs/events.md` §2, computed from a
//! request's token ids so that the router probes the keys engines publish.
//!
//! vLLM's `sha256_cbor`: the digest of block `i` is
//! `SHA-256(CBOR([parent, tokens, extra_keys]))` with `parent` the 32-byte
//! digest of block `i − 1` (for block 0: `NONE_HASH = SHA-256(CBOR(seed))`),
//! `tokens` the block's token ids as an array of unsigned integers and
//! `extra_keys` `null` (namespace 0) or the request's keys (a cache salt
//! on the first block, a LoRA adapter on every block; [`RequestKeys`]); CBOR in its canonical
//! (shortest) form, as `cbor2.dumps(canonical=True)` writes it. On the wire
//! a block hash is the digest's last 8 bytes as a big-endian integer.
//!
//! Written here from the document rather than shared with the publisher's
//! crate, so that the two are checked against each other and against the
//! document's test vectors.

use sha2::{Digest, Sha256};

use crate::index::BlockHash;

/// vLLM's default seed for `NONE_HASH` (when `PYTHONHASHSEED` is unset).
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// A 32-byte block digest (what the chain carries from block to block).
pub type Digest32 = [u8; 32];

/// How an engine publishes a cache namespace `n != 0` (docs/events.md §2;
/// libmarconi's `marconi_event_namespaces`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Namespaces {
    /// vLLM's `cache_salt = str(n)` (the first block only).
    #[default]
    CacheSalt,
    /// vLLM's LoRA adapter named `str(n)`, empty path (every block).
    Lora,
    /// The earlier form: extra keys `[n]` on every block.
    ExtraKeys,
}

/// The extra keys of a request's blocks, as vLLM's
/// `generate_block_hash_extra_keys` builds them from the request: the LoRA
/// adapter `("lora", name, path)` on every block, then the cache salt
/// `("cache_salt", salt)` on the first block only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestKeys {
    /// The LoRA adapter's name and path.
    pub lora: Option<(String, String)>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
}

impl RequestKeys {
    /// The keys namespace `ns` is hashed with under `form` (`None`: the
    /// integer form `[ns]`, which is no request's keys).
    pub fn of_namespace(ns: u64, form: Namespaces) -> Option<Self> {
        match (ns, form) {
            (0, _) => Some(RequestKeys::default()),
            (n, Namespaces::CacheSalt) => Some(RequestKeys {
                lora: None,
                cache_salt: Some(n.to_string()),
            }),
            (n, Namespaces::Lora) => Some(RequestKeys {
                lora: Some((n.to_string(), String::new())),
                cache_salt: None,
            }),
            (_, Namespaces::ExtraKeys) => None,
        }
    }

    /// The CBOR of block `i`'s extra keys (`null` when it has none).
    fn cbor(&self, first: bool, buf: &mut Vec<u8>) {
        let salt = self.cache_salt.as_deref().filter(|_| first);
        let n = usize::from(self.lora.is_some()) + usize::from(salt.is_some());
        if n == 0 {
            buf.push(0xf6);
            return;
        }
        cbor_head(buf, 4, n as u64);
        if let Some((name, path)) = &self.lora {
            cbor_head(buf, 4, 3);
            cbor_text(buf, "lora");
            cbor_text(buf, name);
            cbor_text(buf, path);
        }
        if let Some(salt) = salt {
            cbor_head(buf, 4, 2);
            cbor_text(buf, "cache_salt");
            cbor_text(buf, salt);
        }
    }
}

/// Chained block hashes for one seed and block size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainHasher {
    none_hash: Digest32,
    block_size: usize,
    namespaces: Namespaces,
}

impl ChainHasher {
    /// Hashes of `block_size`-token blocks chained from `SHA-256(CBOR(seed))`,
    /// namespaces as vLLM's cache salt ([`Namespaces::CacheSalt`]).
    /// `block_size` must be > 0 (the index checks it first).
    pub fn new(seed: &str, block_size: u32) -> Self {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        cbor_text(&mut buf, seed);
        ChainHasher {
            none_hash: Sha256::digest(&buf).into(),
            block_size: (block_size as usize).max(1),
            namespaces: Namespaces::default(),
        }
    }

    /// This hasher with namespaces read as `form`.
    pub fn with_namespaces(mut self, form: Namespaces) -> Self {
        self.namespaces = form;
        self
    }

    /// The parent of block 0.
    pub fn none_hash(&self) -> &Digest32 {
        &self.none_hash
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The digest of `tokens` (one block) after `parent` in namespace `ns`;
    /// `parent` is [`none_hash`](Self::none_hash) for a chain's first
    /// block. `buf` is scratch space, reused between calls.
    pub fn block(&self, parent: &Digest32, tokens: &[u32], ns: u64, buf: &mut Vec<u8>) -> Digest32 {
        let first = parent == &self.none_hash;
        match RequestKeys::of_namespace(ns, self.namespaces) {
            Some(keys) => self.block_keyed(parent, tokens, &keys, first, buf),
            None => {
                self.block_head(parent, tokens, buf);
                cbor_head(buf, 4, 1);
                cbor_head(buf, 0, ns);
                Sha256::digest(&buf[..]).into()
            }
        }
    }

    /// The digest of `tokens` (one block, the chain's first when `first`)
    /// after `parent`, with a request's extra keys.
    pub fn block_keyed(
        &self,
        parent: &Digest32,
        tokens: &[u32],
        keys: &RequestKeys,
        first: bool,
        buf: &mut Vec<u8>,
    ) -> Digest32 {
        self.block_head(parent, tokens, buf);
        keys.cbor(first, buf);
        Sha256::digest(&buf[..]).into()
    }

    /// `[parent, tokens, ` of a block's CBOR.
    fn block_head(&self, parent: &Digest32, tokens: &[u32], buf: &mut Vec<u8>) {
        buf.clear();
        cbor_head(buf, 4, 3);
        cbor_head(buf, 2, 32);
        buf.extend_from_slice(parent);
        cbor_head(buf, 4, tokens.len() as u64);
        for &t in tokens {
            cbor_head(buf, 0, u64::from(t));
        }
    }

    /// Appends to `out` the wire hashes of the whole blocks of `tokens`
    /// (a trailing partial block has none), from block 0 of namespace `ns`.
    pub fn wire_hashes(&self, tokens: &[u32], ns: u64, out: &mut Vec<BlockHash>) {
        let mut buf = Vec::with_capacity(48 + self.block_size * 5);
        let mut parent = self.none_hash;
        out.reserve(tokens.len() / self.block_size);
        for block in tokens.chunks_exact(self.block_size) {
            parent = self.block(&parent, block, ns, &mut buf);
            out.push(wire(&parent));
        }
    }

    /// [`wire_hashes`](Self::wire_hashes) of a request with extra keys
    /// (a cache salt, a LoRA adapter).
    pub fn wire_hashes_keyed(&self, tokens: &[u32], keys: &RequestKeys, out: &mut Vec<BlockHash>) {
        let mut buf = Vec::with_capacity(64 + self.block_size * 5);
        let mut parent = self.none_hash;
        out.reserve(tokens.len() / self.block_size);
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            parent = self.block_keyed(&parent, block, keys, i == 0, &mut buf);
            out.push(wire(&parent));
        }
    }
}

/// A digest's wire form: its last 8 bytes, big endian (vLLM's integer
/// `ExternalBlockHash`).
pub fn wire(d: &Digest32) -> BlockHash {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[24..]);
    u64::from_be_bytes(b)
}

/// A CBOR text string.
fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// A CBOR head (major type, argument) in its shortest form (RFC 8949 §3).
fn cbor_head(buf: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        buf.push(m | arg as u8);
    } else if arg <= 0xff {
        buf.extend_from_slice(&[m | 24, arg as u8]);
    } else if arg <= 0xffff {
        buf.push(m | 25);
        buf.extend_from_slice(&(arg as u16).to_be_bytes());
    } else if arg <= 0xffff_ffff {
        buf.push(m | 26);
        buf.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&arg.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortest_cbor_heads() {
        for (arg, want) in [
            (0u64, &[0x00u8][..]),
            (23, &[0x17]),
            (24, &[0x18, 24]),
            (256, &[0x19, 1, 0]),
            (70_000, &[0x1a, 0, 1, 0x11, 0x70]),
            (1 << 32, &[0x1b, 0, 0, 0, 1, 0, 0, 0, 0]),
        ] {
            let mut b = Vec::new();
            cbor_head(&mut b, 0, arg);
            assert_eq!(b, want, "{arg}");
        }
    }

    fn hex(d: &Digest32) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// docs/events.md §2's test vectors (computed there with Python's
    /// cbor2 and hashlib).
    #[test]
    fn the_documented_test_vectors() {
        let h = ChainHasher::new(DEFAULT_SEED, 4);
        assert_eq!(
            hex(h.none_hash()),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        let mut buf = Vec::new();
        let b0 = h.block(h.none_hash(), &[1, 2, 3, 4], 0, &mut buf);
        assert_eq!(
            buf.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "8358209bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef08401020304f6"
        );
        assert_eq!(
            hex(&b0),
            "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"
        );
        let mut w = Vec::new();
        h.wire_hashes(&(1..=12).collect::<Vec<u32>>(), 0, &mut w);
        assert_eq!(
            w,
            vec![
                9561501211280363793,
                15292913576410714033,
                16642949654738151050
            ]
        );
        let widths = h.block(
            h.none_hash(),
            &[0, 23, 24, 255, 256, 65535, 65536, 4294967295],
            0,
            &mut buf,
        );
        assert_eq!(wire(&widths), 16161207721250838591);
        let ints = h.clone().with_namespaces(Namespaces::ExtraKeys);
        let ns7 = ints.block(h.none_hash(), &[1, 2, 3, 4], 7, &mut buf);
        assert!(buf.ends_with(&[0x81, 0x07]));
        assert_eq!(wire(&ns7), 13126870232269019263);
        // Namespace 7 as vLLM's cache_salt "7", and as its LoRA "7".
        let mut w = Vec::new();
        h.wire_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 7, &mut w);
        assert_eq!(w, vec![917973243967164272, 12074054696094627711]);
        let salt = RequestKeys {
            lora: None,
            cache_salt: Some("7".into()),
        };
        let mut keyed = Vec::new();
        h.wire_hashes_keyed(&[1, 2, 3, 4, 5, 6, 7, 8], &salt, &mut keyed);
        assert_eq!(keyed, w);
        w.clear();
        let lora = h.clone().with_namespaces(Namespaces::Lora);
        lora.wire_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 7, &mut w);
        assert_eq!(w[1], 14975206756321946672);
        assert_eq!(
            hex(ChainHasher::new("0", 4).none_hash()),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
    }

    #[test]
    fn chains_depend_on_every_earlier_block_and_the_namespace() {
        let h = ChainHasher::new(DEFAULT_SEED, 2);
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        h.wire_hashes(&[1, 2, 3, 4, 5], 0, &mut a);
        h.wire_hashes(&[9, 2, 3, 4], 0, &mut b);
        h.wire_hashes(&[1, 2, 3, 4], 7, &mut c);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[0], c[0]);
        let mut again = Vec::new();
        h.wire_hashes(&[1, 2, 3, 4], 0, &mut again);
        assert_eq!(again, a);
    }
}
