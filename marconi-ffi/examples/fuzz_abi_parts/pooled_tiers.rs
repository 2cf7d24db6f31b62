//! The fuzzer's engine model for a cache over memfd pools with lower tiers
//! below them (marconi_cache_config.pools and .tiers, written through). It
//! keeps host and store copies by (namespace, tokens), carries out every
//! drained op (a host WRITE reads units of the admission just made, at a
//! position among its states; a store WRITE needs a host copy; a DROP a
//! copy) and every load order of a lease (from a copy it holds, into the
//! request's reserved units). Units carry a signature of the tokens they
//! stand for in their first bytes (pages: the tokens up to their end;
//! states: their prefix), so device hits, the sources of host WRITEs and
//! the loaded bytes are checked too.

use std::collections::HashMap;
use std::ptr;

use marconi::cache::*;
use marconi::cycle::{marconi_cache_drain_with, marconi_drain};
use marconi::pool::*;
use marconi::pooled::*;
use marconi::status::marconi_status as St;
use marconi::tiered::*;

use crate::common::{drain_buffers, last_error};
use crate::is_state;

/// Bytes of a unit's signature.
pub(crate) const SIG: usize = 64;

type Sig = [u8; SIG];

fn sig(tokens: &[u32], salt: u64) -> Sig {
    // FNV-1a over the tokens, then xorshift: cheap and deterministic.
    let mut x: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
    for &t in tokens {
        x = (x ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    x |= 1;
    let mut out = [0u8; SIG];
    for b in &mut out {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    out
}

/// What page `i` (of `page` tokens) of a sequence starting with `tokens`
/// holds.
pub(crate) fn kv_sig(tokens: &[u32], page: u32, i: usize) -> Sig {
    sig(&tokens[..(i + 1) * page as usize], 0x6b76)
}

/// What the state after `tokens` holds.
pub(crate) fn state_sig(tokens: &[u32]) -> Sig {
    sig(tokens, 0x5747)
}

/// The first SIG bytes of live unit `h` of `c`, or why not.
pub(crate) fn unit<'a>(c: *const marconi_cache, h: u64) -> Result<&'a mut [u8], String> {
    let mut loc = marconi_unit_location::default();
    // SAFETY: one handle, one location.
    let st = unsafe { marconi_cache_resolve(c, &h, 1, &mut loc, 1) };
    if st != St::Ok {
        return Err(format!("resolve {h:#x}: {st:?} ({})", last_error()));
    }
    if loc.address == 0 || (loc.unit_bytes as usize) < SIG {
        return Err(format!("{h:#x}: no memfd unit of {SIG} bytes: {loc:?}"));
    }
    // SAFETY: a live memfd unit of at least SIG bytes, mapped in this
    // process while the handle is live; the slice is used before any call
    // that could free it.
    Ok(unsafe { std::slice::from_raw_parts_mut(loc.address as *mut u8, SIG) })
}

fn read(c: *const marconi_cache, h: u64) -> Result<Sig, String> {
    let mut s = [0u8; SIG];
    s.copy_from_slice(unit(c, h)?);
    Ok(s)
}

/// Writes `s` into unit `h` of `c`; a finding when it cannot.
pub(crate) fn write(c: *const marconi_cache, h: u64, s: &Sig) -> Result<(), String> {
    unit(c, h)?.copy_from_slice(s);
    Ok(())
}

/// A chain's signatures held by the engine in a lower tier.
#[derive(Clone)]
struct Copy {
    state: Sig,
    pages: Vec<Sig>,
}

/// The units an admission was given (a host WRITE reads them).
pub(crate) struct Admission<'a> {
    pub(crate) pages: &'a [u64],
    pub(crate) states: &'a [marconi_pooled_state],
}

/// What the loads of a lease brought.
pub(crate) struct Loaded {
    /// Pages filled from the start (the device hit's and the loaded ones).
    pub(crate) pages_to: usize,
    /// The position of the state loaded, if any.
    pub(crate) state: Option<u32>,
}

/// The engine's lower-tier copies and counters.
pub(crate) struct TierModel {
    page: u32,
    /// Host and store copies by (namespace, chain).
    copies: [HashMap<(u64, Vec<u32>), Copy>; 2],
    pub(crate) requests: u64,
    pub(crate) lower_hits: u64,
    pub(crate) device_hits: u64,
    pub(crate) host_writes: u64,
    pub(crate) store_writes: u64,
    pub(crate) drops: u64,
    /// Drain through marconi_cache_drain_with (the ops and the freed units
    /// in one call) instead of marconi_cache_drain_ops.
    pub(crate) one_drain: bool,
    /// Units the one drain freed, for the caller to take.
    freed: Vec<u64>,
}

fn tier_index(tier: u32) -> Option<usize> {
    match tier {
        t if t == marconi_tier::Host as u32 => Some(0),
        t if t == marconi_tier::Store as u32 => Some(1),
        _ => None,
    }
}

impl TierModel {
    pub(crate) fn new(page: u32) -> Self {
        TierModel {
            page,
            copies: [HashMap::new(), HashMap::new()],
            requests: 0,
            lower_hits: 0,
            device_hits: 0,
            host_writes: 0,
            store_writes: 0,
            drops: 0,
            one_drain: false,
            freed: Vec::new(),
        }
    }

    /// The units the one drain gave since the last call (already back in
    /// their pools: stale).
    pub(crate) fn take_freed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.freed)
    }

    /// The ops and chain tokens of `c` through marconi_cache_drain_ops, or
    /// through marconi_cache_drain_with with its freed units kept; Err
    /// holds the findings.
    fn fetch_ops(
        &mut self,
        c: *const marconi_cache,
    ) -> Result<(Vec<marconi_tier_op>, Vec<u32>), Vec<String>> {
        if !self.one_drain {
            return drain_ops(c);
        }
        let d = drain_with(c)?;
        self.freed.extend(d.units);
        Ok((d.ops, d.toks))
    }

    /// Drains the ops of `c` and carries them out; `adm` is the admission
    /// just made (None: a host WRITE is a finding). Returns the findings.
    pub(crate) fn drain(
        &mut self,
        c: *const marconi_cache,
        adm: Option<&Admission>,
    ) -> Vec<String> {
        let mut found = Vec::new();
        let (ops, toks) = match self.fetch_ops(c) {
            Ok(o) => o,
            Err(f) => return f,
        };
        let nt = toks.len();
        for op in &ops {
            let s = op.tokens_offset as usize;
            let Some(prefix) = toks.get(s..s + op.position as usize) else {
                found.push(format!("tier op {op:?} points past the tokens ({nt})"));
                continue;
            };
            let key = (op.ns, prefix.to_vec());
            let Some(t) = tier_index(op.tier) else {
                found.push(format!("tier op on the device: {op:?}"));
                continue;
            };
            if op.kind == marconi_tier_op_kind::Drop as u32 {
                if self.copies[t].remove(&key).is_none() {
                    found.push(format!(
                        "DROP from tier {} of a chain of {} tokens the engine never copied",
                        op.tier, op.position
                    ));
                }
                self.drops += 1;
            } else if op.kind != marconi_tier_op_kind::Write as u32 {
                found.push(format!("tier op of unknown kind {op:?}"));
            } else if t == 1 {
                match self.copies[0].get(&key).cloned() {
                    Some(copy) => {
                        self.copies[1].insert(key, copy);
                    }
                    None => found.push(format!(
                        "STORE WRITE of a chain of {} tokens without a host copy",
                        op.position
                    )),
                }
                self.store_writes += 1;
            } else {
                self.host_writes += 1;
                let Some(adm) = adm else {
                    found.push(format!(
                        "host WRITE of a chain of {} tokens outside an admission",
                        op.position
                    ));
                    continue;
                };
                let Some(s) = adm.states.iter().find(|s| s.position == op.position) else {
                    found.push(format!(
                        "host WRITE at {} names no state of the admission (positions {:?})",
                        op.position,
                        adm.states.iter().map(|s| s.position).collect::<Vec<_>>()
                    ));
                    continue;
                };
                let n = op.position.div_ceil(self.page) as usize;
                if n > adm.pages.len() {
                    found.push(format!(
                        "host WRITE at {} reads {n} pages of an admission of {}",
                        op.position,
                        adm.pages.len()
                    ));
                    continue;
                }
                let copy = (|| -> Result<Copy, String> {
                    Ok(Copy {
                        state: read(c, s.state_handle)?,
                        pages: adm.pages[..n]
                            .iter()
                            .map(|&h| read(c, h))
                            .collect::<Result<_, _>>()?,
                    })
                })();
                match copy {
                    Err(e) => found.push(format!("host WRITE at {}: {e}", op.position)),
                    Ok(copy) => {
                        if copy.state != state_sig(prefix) {
                            found.push(format!(
                                "host WRITE at {}: its state slot holds another state",
                                op.position
                            ));
                        }
                        if let Some(i) =
                            (0..n).find(|&i| copy.pages[i] != kv_sig(prefix, self.page, i))
                        {
                            found.push(format!(
                                "host WRITE at {}: its page {i} holds other KV",
                                op.position
                            ));
                        }
                        self.copies[0].insert(key, copy);
                    }
                }
            }
        }
        found
    }

    /// Checks the device hit of `l` (its pages `hit`, its state) by bytes.
    pub(crate) fn check_hit(
        &self,
        c: *const marconi_cache,
        tokens: &[u32],
        l: &marconi_pooled_lookup,
        hit: &[u64],
    ) -> Vec<String> {
        let mut found = Vec::new();
        for (i, &h) in hit.iter().enumerate() {
            match read(c, h) {
                Ok(s) if s == kv_sig(tokens, self.page, i) => {}
                Ok(_) => found.push(format!("device hit page {i} ({h:#x}) holds other KV")),
                Err(e) => found.push(format!("device hit page {i}: {e}")),
            }
        }
        if l.state_handle != 0 {
            match read(c, l.state_handle) {
                Ok(s) if s == state_sig(&tokens[..l.hit_tokens as usize]) => {}
                Ok(_) => found.push(format!(
                    "device hit state at {} holds another state",
                    l.hit_tokens
                )),
                Err(e) => found.push(format!("device hit state: {e}")),
            }
        }
        found
    }

    /// Carries out the loads of lease `l` (its device pages `pages[..n]`,
    /// reserved pages after them) from the engine's copies: KV into the
    /// reserved pages, the state into `slot`. Returns what was loaded and
    /// the findings.
    pub(crate) fn load(
        &mut self,
        c: *const marconi_cache,
        ns: u64,
        tokens: &[u32],
        l: &marconi_pooled_lookup,
        pages: &[u64],
        slot: u64,
    ) -> (Loaded, Vec<String>) {
        self.requests += 1;
        let mut found = Vec::new();
        let n_dev = l.n_kv_pages as usize;
        let mut out = Loaded {
            pages_to: n_dev,
            state: None,
        };
        let mut buf = vec![marconi_load_order::default(); 8];
        let mut n = 0usize;
        // SAFETY: buf has its length in writable orders.
        let st =
            unsafe { marconi_cache_lease_loads(c, l.lease, buf.as_mut_ptr(), buf.len(), &mut n) };
        if st != St::Ok {
            found.push(format!("lease_loads: {st:?} ({})", last_error()));
            return (out, found);
        }
        buf.truncate(n);
        let page = self.page;
        for o in &buf {
            let Some(t) = tier_index(o.tier) else {
                found.push(format!("a load from the device: {o:?}"));
                continue;
            };
            if o.kind == marconi_load_kind::Kv as u32 {
                let end = o.end as usize;
                let src = (end <= tokens.len())
                    .then(|| {
                        self.copies[t].iter().find(|((m, chain), _)| {
                            *m == ns && chain.len() >= end && chain[..end] == tokens[..end]
                        })
                    })
                    .flatten()
                    .map(|(_, c)| c.clone());
                let Some(src) = src else {
                    found.push(format!(
                        "a KV load of {}..{} from tier {} reads no copy the engine holds",
                        o.start, o.end, o.tier
                    ));
                    continue;
                };
                let first = (o.start / page) as usize;
                let last = o.end.div_ceil(page) as usize;
                if first < n_dev || last > pages.len() || last > src.pages.len() {
                    found.push(format!(
                        "a KV load of {}..{} over {n_dev} device pages, {} pages in all, a copy of {}",
                        o.start,
                        o.end,
                        pages.len(),
                        src.pages.len()
                    ));
                    continue;
                }
                for (i, &h) in pages.iter().enumerate().take(last).skip(first) {
                    if src.pages[i] != kv_sig(tokens, page, i) {
                        found.push(format!("the engine's copy of page {i} holds other KV"));
                    }
                    if let Err(e) = write(c, h, &src.pages[i]) {
                        found.push(format!("loading page {i}: {e}"));
                    }
                    out.pages_to = out.pages_to.max(i + 1);
                }
            } else if o.kind == marconi_load_kind::State as u32 {
                let p = o.position as usize;
                let src = (p <= tokens.len())
                    .then(|| self.copies[t].get(&(ns, tokens[..p].to_vec())))
                    .flatten()
                    .cloned();
                match src {
                    None => found.push(format!(
                        "a state load at {p} from tier {} reads no copy the engine holds",
                        o.tier
                    )),
                    Some(src) => {
                        if src.state != state_sig(&tokens[..p]) {
                            found.push(format!("the engine's copy of the state at {p} is another"));
                        }
                        if let Err(e) = write(c, slot, &src.state) {
                            found.push(format!("loading the state at {p}: {e}"));
                        }
                        out.state = Some(o.position);
                    }
                }
            } else {
                found.push(format!("a load of unknown kind {o:?}"));
            }
        }
        let lower_hit = l.state_handle == 0 && l.hit_tokens > 0;
        if lower_hit {
            self.lower_hits += 1;
            if out.state != Some(l.hit_tokens) {
                found.push(format!(
                    "a lower tier's hit of {} tokens without its state loaded ({:?})",
                    l.hit_tokens, buf
                ));
            }
            if (out.pages_to as u32) * page < l.hit_tokens {
                found.push(format!(
                    "a lower tier's hit of {} tokens with KV for {} only (device pages {n_dev}, loads {buf:?})",
                    l.hit_tokens,
                    out.pages_to as u32 * page
                ));
            }
        } else if l.hit_tokens > 0 {
            self.device_hits += 1;
        }
        if !lower_hit && !buf.is_empty() {
            found.push(format!("loads without a lower tier's hit: {buf:?}"));
        }
        (out, found)
    }
}

/// The units of `c`'s pools in use are the cache's plus the caller's
/// (`caller`: KV pages, state slots), and `marconi_cache_check` passes;
/// with none the caller's (between requests), no lease is out and nothing
/// is pinned. Else a finding (what: where).
pub(crate) fn check_units(
    c: *const marconi_cache,
    caller: (u64, u64),
    what: &str,
) -> Option<String> {
    // SAFETY: live handle.
    let st = unsafe { marconi_cache_check(c) };
    if st != St::Ok {
        return Some(format!(
            "{what}: marconi_cache_check {st:?} ({})",
            last_error()
        ));
    }
    let mut s = marconi_pooled_stats {
        struct_size: std::mem::size_of::<marconi_pooled_stats>() as u32,
        ..Default::default()
    };
    // SAFETY: live handle, out sized by struct_size.
    let st = unsafe { marconi_cache_pool_stats(c, &mut s) };
    if st != St::Ok {
        return Some(format!("{what}: pool_stats {st:?}"));
    }
    if caller == (0, 0) {
        // Between requests: no lease out, in the handle or the device.
        let mut cs = marconi_stats {
            struct_size: std::mem::size_of::<marconi_stats>() as u32,
            ..Default::default()
        };
        // SAFETY: live handle, out sized by struct_size.
        let st = unsafe { marconi_cache_stats(c, &mut cs) };
        if st != St::Ok || s.leases != 0 || cs.leases != 0 || cs.evictable_bytes != cs.used_bytes {
            return Some(format!(
                "{what}: {st:?}, leases {} (device {}), evictable {} of {} with none out",
                s.leases, cs.leases, cs.evictable_bytes, cs.used_bytes
            ));
        }
    }
    let used = (s.kv_capacity - s.kv_free, s.state_capacity - s.state_free);
    let held = (s.held_kv_pages + caller.0, s.held_state_slots + caller.1);
    (used != held).then(|| {
        format!(
            "{what}: units in use (KV, states) {used:?}, the cache's {:?} and the caller's {caller:?}: a leak or a double owner",
            (s.held_kv_pages, s.held_state_slots)
        )
    })
}

/// The ops and chain tokens of `c` through marconi_cache_drain_ops: a size
/// query, then a drain into exact room; Err holds the findings.
fn drain_ops(c: *const marconi_cache) -> Result<(Vec<marconi_tier_op>, Vec<u32>), Vec<String>> {
    let (mut no, mut nt) = (0usize, 0usize);
    // SAFETY: a size query (NULL buffers, capacity 0).
    let st = unsafe {
        marconi_cache_drain_ops(c, ptr::null_mut(), 0, &mut no, ptr::null_mut(), 0, &mut nt)
    };
    if no == 0 {
        return if st == St::Ok {
            Ok((Vec::new(), Vec::new()))
        } else {
            Err(vec![format!(
                "drain_ops (size query, none): {st:?} ({})",
                last_error()
            )])
        };
    }
    if st != St::BufferTooSmall {
        return Err(vec![format!("drain_ops size query of {no} ops: {st:?}")]);
    }
    let mut ops = vec![marconi_tier_op::default(); no];
    let mut toks = vec![0u32; nt];
    let (mut wo, mut wt) = (0usize, 0usize);
    // SAFETY: buffers of their lengths.
    let st = unsafe {
        marconi_cache_drain_ops(
            c,
            ops.as_mut_ptr(),
            no,
            &mut wo,
            toks.as_mut_ptr(),
            nt,
            &mut wt,
        )
    };
    if st != St::Ok || (wo, wt) != (no, nt) {
        return Err(vec![format!(
            "drain_ops: {st:?}, {wo} ops / {wt} tokens after a query of {no} / {nt}"
        )]);
    }
    Ok((ops, toks))
}

/// What marconi_cache_drain_with gave: the tier ops with their chain
/// tokens, and the freed units (KV pages, then state slots).
#[derive(Default)]
pub(crate) struct Drained {
    pub(crate) ops: Vec<marconi_tier_op>,
    pub(crate) toks: Vec<u32>,
    pub(crate) units: Vec<u64>,
}

/// Everything a cache over pools that no one else drains has to drain,
/// through marconi_cache_drain_with: a size query, then a drain into exact
/// room; the pages must be KV handles and the slots state handles, none
/// twice. Err holds the findings.
pub(crate) fn drain_with(c: *const marconi_cache) -> Result<Drained, Vec<String>> {
    for n in &crate::VIA_WITH[2..] {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let mut d = marconi_drain::default();
    // SAFETY: a size query (NULL buffers, capacity 0).
    let st = unsafe { marconi_cache_drain_with(c, &mut d) };
    let counted = (d.n_ops, d.n_op_tokens, d.n_kv_pages, d.n_state_slots);
    if counted == (0, 0, 0, 0) {
        return if st == St::Ok {
            Ok(Drained::default())
        } else {
            Err(vec![format!(
                "drain_with (size query, none): {st:?} ({})",
                last_error()
            )])
        };
    }
    if st != St::BufferTooSmall {
        return Err(vec![format!(
            "drain_with size query of {counted:?}: {st:?}"
        )]);
    }
    let b = drain_buffers(&mut d, 0);
    // SAFETY: d points into b's buffers, with their capacities.
    let st = unsafe { marconi_cache_drain_with(c, &mut d) };
    let got = (d.n_ops, d.n_op_tokens, d.n_kv_pages, d.n_state_slots);
    if st != St::Ok || got != counted {
        return Err(vec![format!(
            "drain_with: {st:?}, drained {got:?} after a query of {counted:?}"
        )]);
    }
    let mut found = Vec::new();
    if let Some(h) = b.pages.iter().find(|&&h| is_state(h)) {
        found.push(format!(
            "drain_with: kv_pages holds the state handle {h:#x}"
        ));
    }
    if let Some(h) = b.slots.iter().find(|&&h| !is_state(h)) {
        found.push(format!(
            "drain_with: state_slots holds the KV handle {h:#x}"
        ));
    }
    let units: Vec<u64> = b.pages.iter().chain(&b.slots).copied().collect();
    let mut once = units.clone();
    once.sort_unstable();
    once.dedup();
    if once.len() != units.len() {
        found.push("drain_with: a unit drained twice".into());
    }
    if found.is_empty() {
        Ok(Drained {
            ops: b.ops,
            toks: b.toks,
            units,
        })
    } else {
        Err(found)
    }
}
