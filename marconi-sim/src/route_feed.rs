//! How a simulated engine tells the router what its cache holds: the
//! engine runs its request cycle with real page and slot ids (lookup, the
//! states the plan asks for, admit with one page id per whole page,
//! release), remembers which block hash each id it handed to the cache
//! stands for, and turns what the cache takes (`AdmitOutcome`) and frees
//! (`drain_freed`) into index events. Exact by construction: an id names a
//! block of one chain for as long as the cache owns it.

use marconi_core::{CacheError, PrefixCache, SavedState};
use marconi_router::{BlockHash, IndexEvent};

/// What one request found in its engine's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Tokens skipped (a state to resume from).
    pub hit_tokens: u32,
    /// Leading tokens whose KV was cached.
    pub kv_matched_tokens: u32,
}

/// Ids to block hashes of one engine, and its pending events.
#[derive(Debug)]
pub struct EngineFeed {
    page_size: u32,
    /// Block hash of each page id the cache owns.
    pages: Vec<Option<BlockHash>>,
    free_pages: Vec<u32>,
    /// Block hash (the block ending at the state) of each slot the cache owns.
    slots: Vec<Option<BlockHash>>,
    free_slots: Vec<u32>,
    pending: Vec<IndexEvent>,
}

fn take_id(map: &mut Vec<Option<BlockHash>>, free: &mut Vec<u32>) -> u32 {
    free.pop().unwrap_or_else(|| {
        map.push(None);
        (map.len() - 1) as u32
    })
}

impl EngineFeed {
    /// A feed for an empty cache with `page_size`-token pages.
    pub fn new(page_size: u32) -> Self {
        EngineFeed {
            page_size: page_size.max(1),
            pages: Vec::new(),
            free_pages: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Serves one request on `cache` as an engine does: `full[..input_len]`
    /// is looked up, then `full` admitted with the states the plan asks for
    /// and a page id per whole page, then the lease released. `hashes` are
    /// the block hashes of `full`'s whole blocks. Records the events.
    pub fn serve(
        &mut self,
        cache: &mut PrefixCache,
        input_len: usize,
        full: &[u32],
        hashes: &[BlockHash],
    ) -> Result<Served, CacheError> {
        let ps = self.page_size as usize;
        debug_assert_eq!(hashes.len(), full.len() / ps);
        let l = cache.lookup(0, &full[..input_len.min(full.len())])?;
        let served = Served {
            hit_tokens: l.hit_tokens,
            kv_matched_tokens: l.kv_matched_tokens,
        };
        let mut states = cache.states_to_save(&l, full.len());
        for s in &mut states {
            s.slot = Some(take_id(&mut self.slots, &mut self.free_slots));
        }
        let pages: Vec<u32> = (0..hashes.len())
            .map(|_| take_id(&mut self.pages, &mut self.free_pages))
            .collect();
        let admitted = cache.admit(l.lease, full, &states, &pages);
        let release = cache.release(l.lease);
        // On a refusal nothing changed: every id comes back.
        let out = match admitted {
            Ok(out) => out,
            Err(e) => {
                self.give_back_pages(&pages, 0..0);
                self.give_back_slots(&states, &[]);
                self.freed(cache);
                return Err(e);
            }
        };
        let taken = out.kv_pages_taken.start as usize..out.kv_pages_taken.end as usize;
        if !taken.is_empty() {
            for i in taken.clone() {
                self.pages[pages[i] as usize] = Some(hashes[i]);
            }
            self.pending.push(IndexEvent::BlocksStored {
                block_hashes: hashes[taken.clone()].to_vec(),
                block_size: self.page_size,
            });
        }
        self.give_back_pages(&pages, taken);
        let mut positions = out.states_taken.clone();
        positions.sort_unstable();
        for &p in &positions {
            let slot = states
                .iter()
                .find(|s| s.position == p)
                .and_then(|s| s.slot)
                .expect("the cache takes states it was given");
            let block = p as usize / ps;
            debug_assert!(block >= 1 && p as usize % ps == 0);
            let h = hashes[block - 1];
            self.slots[slot as usize] = Some(h);
            self.pending.push(IndexEvent::StateStored { block_hash: h });
        }
        self.give_back_slots(&states, &positions);
        // After the stores: an id taken and freed within the same call is
        // stored, then removed.
        self.freed(cache);
        release?;
        Ok(served)
    }

    fn give_back_pages(&mut self, pages: &[u32], taken: std::ops::Range<usize>) {
        for (i, &p) in pages.iter().enumerate() {
            if !taken.contains(&i) {
                self.free_pages.push(p);
            }
        }
    }

    fn give_back_slots(&mut self, states: &[SavedState], taken: &[u32]) {
        for s in states {
            if !taken.contains(&s.position) {
                if let Some(slot) = s.slot {
                    self.free_slots.push(slot);
                }
            }
        }
    }

    /// Publishes what the cache freed: removals, states first.
    fn freed(&mut self, cache: &mut PrefixCache) {
        let f = cache.drain_freed();
        for slot in f.state_slots {
            if let Some(h) = self.slots[slot as usize].take() {
                self.pending
                    .push(IndexEvent::StateRemoved { block_hash: h });
                self.free_slots.push(slot);
            }
        }
        let mut removed = Vec::with_capacity(f.kv_pages.len());
        for page in f.kv_pages {
            if let Some(h) = self.pages[page as usize].take() {
                removed.push(h);
                self.free_pages.push(page);
            }
        }
        if !removed.is_empty() {
            self.pending.push(IndexEvent::BlocksRemoved {
                block_hashes: removed,
            });
        }
    }

    /// What the cache owns, as this engine recorded it: the block hashes
    /// of its pages and of the blocks its states end, each sorted.
    pub fn held(&self) -> (Vec<BlockHash>, Vec<BlockHash>) {
        let mut blocks: Vec<BlockHash> = self.pages.iter().flatten().copied().collect();
        let mut states: Vec<BlockHash> = self.slots.iter().flatten().copied().collect();
        blocks.sort_unstable();
        states.sort_unstable();
        (blocks, states)
    }

    /// The events since the last call, in order.
    pub fn drain(&mut self) -> std::vec::Drain<'_, IndexEvent> {
        self.pending.drain(..)
    }
}
