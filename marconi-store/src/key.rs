//! Object names: the chained block hashes vLLM's KV events carry
//! (`sha256_cbor`, computed by marconi-events), bound to the model/layout
//! fingerprint, the value layout version and a namespace.

use marconi_events::{BlockHasher, Digest32};
use sha2::{Digest, Sha256};

use crate::error::ConfigError;

/// Domain separation of key derivation (changes only with the key scheme).
const KEY_DOMAIN: &[u8] = b"marconi-store key v1\0";
/// Domain separation of fingerprints.
const FINGERPRINT_DOMAIN: &[u8] = b"marconi-store fingerprint v1\0";

/// What a value is: one KV block, or a recurrent state at a position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KeyKind {
    /// The KV cache of one full block of tokens.
    Kv = 1,
    /// A recurrent (SSM) state after the tokens up to a position.
    State = 2,
}

impl KeyKind {
    /// The kind with this envelope byte.
    pub fn from_u8(v: u8) -> Option<KeyKind> {
        match v {
            1 => Some(KeyKind::Kv),
            2 => Some(KeyKind::State),
            _ => None,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            KeyKind::Kv => "kv",
            KeyKind::State => "st",
        }
    }
}

/// The identity of what produced a value: the model and the byte layout of
/// its KV blocks and states. Values are shared exactly between engines with
/// the same fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The fingerprint of a model description (its name or config digest,
    /// dtype, tensor-parallel layout... whatever makes two engines' bytes
    /// interchangeable), as SHA-256 with a domain prefix.
    pub fn of(model: &str) -> Fingerprint {
        let mut h = Sha256::new();
        h.update(FINGERPRINT_DOMAIN);
        h.update(model.as_bytes());
        Fingerprint(h.finalize().into())
    }
}

/// The key of one value: its kind and a 32-byte digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoreKey {
    /// KV block or state.
    pub kind: KeyKind,
    /// SHA-256 over the key scheme, the fingerprint, the layout version,
    /// the namespace, the position and the chain digest.
    pub digest: [u8; 32],
}

impl StoreKey {
    /// The object name under `prefix`: `{prefix}{kv|st}-{64 hex digits}`.
    pub fn name(&self, prefix: &str) -> String {
        let mut s = String::with_capacity(prefix.len() + 3 + 64);
        s.push_str(prefix);
        s.push_str(self.kind.tag());
        s.push('-');
        for b in self.digest {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
        s
    }
}

/// How keys are made.
#[derive(Clone, Debug)]
pub struct KeyerConfig {
    /// Tokens per KV block (the engine's block or page size), > 0.
    pub block_size: usize,
    /// The seed of `NONE_HASH` (vLLM's `PYTHONHASHSEED`; default
    /// marconi-events' `DEFAULT_SEED`).
    pub seed: String,
    /// The extra key of every block hash (marconi-events' `ns`; 0: none).
    pub ns: u64,
    /// The model/layout fingerprint.
    pub fingerprint: Fingerprint,
    /// The version of the value byte layout (bump it when the engine's
    /// block or state layout changes).
    pub layout_version: u32,
    /// An operator's partition of one store (a tenant, a deployment); ""
    /// for none.
    pub namespace: String,
}

impl KeyerConfig {
    /// A configuration for `model` (see [`Fingerprint::of`]) with blocks of
    /// `block_size` tokens and the defaults.
    pub fn new(model: &str, block_size: usize) -> Self {
        KeyerConfig {
            block_size,
            seed: marconi_events::DEFAULT_SEED.to_owned(),
            ns: 0,
            fingerprint: Fingerprint::of(model),
            layout_version: 1,
            namespace: String::new(),
        }
    }
}

/// Makes the keys of KV blocks and states from token sequences.
#[derive(Clone, Debug)]
pub struct Keyer {
    hasher: BlockHasher,
    cfg: KeyerConfig,
}

impl Keyer {
    /// A keyer; refuses a zero block size.
    pub fn new(cfg: KeyerConfig) -> Result<Keyer, ConfigError> {
        if cfg.block_size == 0 {
            return Err(ConfigError("block_size is 0".into()));
        }
        Ok(Keyer {
            hasher: BlockHasher::new(&cfg.seed),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KeyerConfig {
        &self.cfg
    }

    /// The chained block hashes of `tokens`' full blocks (what vLLM's
    /// `BlockStored` events carry for them).
    pub fn chain(&self, tokens: &[u32]) -> Vec<Digest32> {
        self.chain_ns(self.cfg.ns, tokens)
    }

    /// [`chain`](Self::chain) in cache namespace `ns` (the extra key of
    /// every block hash) instead of the configured one.
    pub fn chain_ns(&self, ns: u64, tokens: &[u32]) -> Vec<Digest32> {
        self.hasher.chain(tokens, self.cfg.block_size, ns)
    }

    /// The keys of `tokens`' full blocks, from block 0.
    pub fn kv_keys(&self, tokens: &[u32]) -> Vec<StoreKey> {
        self.kv_keys_ns(self.cfg.ns, tokens)
    }

    /// [`kv_keys`](Self::kv_keys) in namespace `ns`: no key of another
    /// namespace equals one of these.
    pub fn kv_keys_ns(&self, ns: u64, tokens: &[u32]) -> Vec<StoreKey> {
        self.chain_ns(ns, tokens)
            .iter()
            .enumerate()
            .map(|(i, d)| self.derive(KeyKind::Kv, (i as u64 + 1) * self.cfg.block_size as u64, d))
            .collect()
    }

    /// The key of the state after `tokens[..position]`: the chain of the
    /// full blocks up to `position`, then the partial block's tokens hashed
    /// as a block of their own. `None` when `position` is 0 or past the
    /// tokens.
    pub fn state_key(&self, tokens: &[u32], position: usize) -> Option<StoreKey> {
        self.state_key_ns(self.cfg.ns, tokens, position)
    }

    /// [`state_key`](Self::state_key) in namespace `ns`.
    pub fn state_key_ns(&self, ns: u64, tokens: &[u32], position: usize) -> Option<StoreKey> {
        if position == 0 || position > tokens.len() {
            return None;
        }
        let bs = self.cfg.block_size;
        let full = position / bs;
        let chain = self.chain_ns(ns, &tokens[..full * bs]);
        let tail = &tokens[full * bs..position];
        let digest = if tail.is_empty() {
            *chain.last()?
        } else {
            self.hasher.hash_block(chain.last(), tail, ns)
        };
        Some(self.derive(KeyKind::State, position as u64, &digest))
    }

    /// [`state_key`](Self::state_key) of each of `positions` (any order),
    /// with the block chain hashed once for all of them: what a probe of
    /// many candidate positions of one input asks for.
    pub fn state_keys(&self, tokens: &[u32], positions: &[usize]) -> Vec<Option<StoreKey>> {
        self.state_keys_ns(self.cfg.ns, tokens, positions)
    }

    /// [`state_keys`](Self::state_keys) in namespace `ns`.
    pub fn state_keys_ns(
        &self,
        ns: u64,
        tokens: &[u32],
        positions: &[usize],
    ) -> Vec<Option<StoreKey>> {
        let bs = self.cfg.block_size;
        let top = positions
            .iter()
            .copied()
            .filter(|&p| p <= tokens.len())
            .max()
            .unwrap_or(0);
        let chain = self.chain_ns(ns, &tokens[..top / bs * bs]);
        positions
            .iter()
            .map(|&position| {
                if position == 0 || position > tokens.len() {
                    return None;
                }
                let full = position / bs;
                let before = full.checked_sub(1).map(|i| &chain[i]);
                let tail = &tokens[full * bs..position];
                let digest = if tail.is_empty() {
                    *before?
                } else {
                    self.hasher.hash_block(before, tail, ns)
                };
                Some(self.derive(KeyKind::State, position as u64, &digest))
            })
            .collect()
    }

    fn derive(&self, kind: KeyKind, position: u64, chain: &Digest32) -> StoreKey {
        let mut h = Sha256::new();
        h.update(KEY_DOMAIN);
        h.update([kind as u8]);
        h.update(self.cfg.fingerprint.0);
        h.update(self.cfg.layout_version.to_le_bytes());
        h.update((self.cfg.namespace.len() as u64).to_le_bytes());
        h.update(self.cfg.namespace.as_bytes());
        h.update(position.to_le_bytes());
        h.update(chain);
        StoreKey {
            kind,
            digest: h.finalize().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyer(model: &str, f: impl FnOnce(&mut KeyerConfig)) -> Keyer {
        let mut c = KeyerConfig::new(model, 4);
        f(&mut c);
        Keyer::new(c).unwrap()
    }

    #[test]
    fn state_keys_are_state_key_for_each_position() {
        let toks: Vec<u32> = (100..123).collect();
        for ns in [0, 7] {
            let k = keyer("m", |c| c.ns = ns);
            let positions: Vec<usize> = vec![23, 0, 1, 4, 5, 8, 12, 13, 24, 3, 16];
            let many = k.state_keys(&toks, &positions);
            for (p, got) in positions.iter().zip(&many) {
                assert_eq!(*got, k.state_key(&toks, *p), "position {p}");
            }
            assert!(many[1].is_none() && many[8].is_none());
            assert!(k.state_keys(&toks, &[]).is_empty());
        }
    }

    #[test]
    fn kv_keys_follow_the_events_chain_and_separate_models_namespaces_versions() {
        let toks: Vec<u32> = (0..10).collect();
        let a = keyer("m", |_| {});
        let ks = a.kv_keys(&toks);
        assert_eq!(ks.len(), 2, "a trailing partial block has no key");
        // Same chain as the events (same seed, block size, ns).
        let chain = BlockHasher::default().chain(&toks, 4, 0);
        assert_eq!(a.chain(&toks), chain);
        // Same model, another engine: same keys.
        assert_eq!(keyer("m", |_| {}).kv_keys(&toks), ks);
        // A longer sequence with the same prefix: same first keys.
        assert_eq!(a.kv_keys(&(0..20).collect::<Vec<_>>())[..2], ks[..]);
        for other in [
            keyer("m2", |_| {}),
            keyer("m", |c| c.namespace = "tenant".into()),
            keyer("m", |c| c.layout_version = 2),
            keyer("m", |c| c.ns = 7),
            keyer("m", |c| c.seed = "s".into()),
        ] {
            let o = other.kv_keys(&toks);
            assert!(o.iter().all(|k| !ks.contains(k)), "{:?}", other.config());
        }
        assert!(ks[0].name("p/").starts_with("p/kv-"));
        assert_eq!(ks[0].name("").len(), 3 + 64);
    }

    #[test]
    fn state_keys_depend_on_every_token_up_to_the_position_and_nothing_after() {
        let k = keyer("m", |_| {});
        let t: Vec<u32> = (0..10).collect();
        assert_eq!(k.state_key(&t, 0), None);
        assert_eq!(k.state_key(&t, 11), None);
        let s6 = k.state_key(&t, 6).unwrap();
        let mut u = t.clone();
        u[9] = 99;
        assert_eq!(k.state_key(&u, 6), Some(s6), "tokens past the position");
        u[5] = 99;
        assert_ne!(k.state_key(&u, 6), Some(s6), "a token of the partial block");
        let mut v = t.clone();
        v[0] = 99;
        assert_ne!(k.state_key(&v, 6), Some(s6), "a token of a full block");
        let s4 = k.state_key(&t, 4).unwrap();
        let s5 = k.state_key(&t, 5).unwrap();
        assert!(s4 != s5 && s4 != s6);
        assert_ne!(
            s4.digest,
            k.kv_keys(&t)[0].digest,
            "a state is not its block"
        );
    }
}
