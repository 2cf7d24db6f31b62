//! The module store: pinning while registered, the budget, eviction by
//! utility once unregistered, and lookups that name how each segment is
//! served and never mix modes.

use marconi_pml::{
    ByteTokenizer, Encoded, Layout, ModuleCache, ModuleModel, ModuleRef, Prompt, ReuseMode,
    SchemaId, Served, StoreError,
};
use proptest::prelude::*;

// sys 0..3, doc 3..9, q 9..13 (p at 10..12), tail 13..15.
const S: &str = r#"<schema name="r">
  <module name="sys">SYS</module>
  <module name="doc">DOCDOC</module>
  <module name="q">Q<param name="p" len="2"/>Z</module>
  <module name="tail">TT</module>
</schema>"#;

// An anonymous text (0..4) and a union (a/b at 4..7).
const U: &str = r#"<schema name="u">
  Head
  <union>
    <module name="a">AAA</module>
    <module name="b">BB</module>
  </union>
  <module name="c">CCCC</module>
</schema>"#;

fn enc(xml: &str) -> Encoded {
    Encoded::new(marconi_pml::Schema::parse(xml).unwrap(), &mut ByteTokenizer).unwrap()
}

fn lay(enc: &Encoded, prompt: &str) -> Layout {
    let p = Prompt::parse(prompt, enc.schema()).unwrap();
    enc.layout(&p, &mut ByteTokenizer).unwrap()
}

fn served(c: &mut ModuleCache, id: SchemaId, l: &Layout, mode: ReuseMode) -> Vec<&'static str> {
    c.lookup(id, l, mode)
        .unwrap()
        .segments
        .iter()
        .map(|s| s.served.as_str())
        .collect()
}

fn named(c: &ModuleCache, id: SchemaId, name: &str) -> ModuleRef {
    c.module_named(id, name).unwrap()
}

#[test]
fn a_module_is_a_miss_until_admitted_then_served_with_its_entry() {
    let e = enc(S);
    let mut c = ModuleCache::new(ModuleModel::attention(10), 10_000).unwrap();
    let id = c.register(&e).unwrap();
    // 15 module tokens (q's 2 placeholders included) at 10 bytes: pinned.
    assert_eq!(c.stats().pinned_bytes, 150);
    let l = lay(&e, r#"<prompt schema="r"><doc/><q p="x"/>ask</prompt>"#);
    assert_eq!(
        served(&mut c, id, &l, ReuseMode::Attention),
        ["miss", "miss", "computed", "miss", "computed"]
    );
    let doc = c.admit(id, named(&c, id, "doc")).unwrap();
    let r = c.lookup(id, &l, ReuseMode::Attention).unwrap();
    assert_eq!(r.segments[0].served, Served::Attention);
    assert_eq!(r.segments[0].entry, Some(doc));
    assert_eq!(r.segments[1].served, Served::Miss);
    assert_eq!(r.segments[1].entry, None);
    // Admitting again returns the same entry.
    assert_eq!(c.admit(id, named(&c, id, "doc")).unwrap(), doc);
    let st = c.stats();
    assert_eq!((st.hits, st.misses, st.lookups), (1, 5, 2));
    assert_eq!((st.entries, st.resident_bytes, st.used_bytes), (1, 60, 150));
}

#[test]
fn modes_that_do_not_apply_are_errors_not_fallbacks() {
    let e = enc(S);
    let l = lay(&e, r#"<prompt schema="r"><sys/></prompt>"#);
    let mut att = ModuleCache::new(ModuleModel::attention(1), 1000).unwrap();
    let id = att.register(&e).unwrap();
    assert_eq!(
        att.lookup(id, &l, ReuseMode::Composed { window: 4 }),
        Err(StoreError::ModeNotApplicable {
            mode: ReuseMode::Composed { window: 4 },
            hybrid: false
        })
    );
    let mut hyb = ModuleCache::new(ModuleModel::hybrid(1, 8, 8), 1000).unwrap();
    let id = hyb.register(&e).unwrap();
    assert!(matches!(
        hyb.lookup(id, &l, ReuseMode::Attention),
        Err(StoreError::ModeNotApplicable { hybrid: true, .. })
    ));
    assert_eq!(hyb.stats().lookups, 0);
}

#[test]
fn hybrid_exact_serves_the_run_from_exact_entries_and_recomputes_the_rest() {
    let e = enc(S);
    let mut c = ModuleCache::new(ModuleModel::hybrid(1, 100, 50), 10_000).unwrap();
    let id = c.register(&e).unwrap();
    // Module entries: 15 tokens + 4 * (100 + 50).
    assert_eq!(c.stats().pinned_bytes, 615);
    let l = lay(&e, r#"<prompt schema="r"><sys/><doc/><tail/>ask</prompt>"#);
    for m in ["sys", "doc", "tail"] {
        c.admit(id, named(&c, id, m)).unwrap();
    }
    // Module entries alone serve nothing exactly: the run needs exact entries.
    assert_eq!(
        served(&mut c, id, &l, ReuseMode::Exact),
        ["miss", "miss", "recomputed", "computed"]
    );
    let e0 = c.admit_exact(id, &l, 0).unwrap();
    let e1 = c.admit_exact(id, &l, 1).unwrap();
    assert_eq!(
        c.admit_exact(id, &l, 2),
        Err(StoreError::NotInExactRun { segment: 2, run: 2 })
    );
    let r = c.lookup(id, &l, ReuseMode::Exact).unwrap();
    assert_eq!(r.exact_run, 2);
    let got: Vec<_> = r.segments.iter().map(|s| (s.served, s.entry)).collect();
    assert_eq!(
        got,
        [
            (Served::Exact, Some(e0)),
            (Served::Exact, Some(e1)),
            (Served::Recomputed, None),
            (Served::Computed, None)
        ]
    );
    // Composed: the run exact, `tail` composed from its module entry.
    let r = c.lookup(id, &l, ReuseMode::Composed { window: 1 }).unwrap();
    let got: Vec<_> = r.segments.iter().map(|s| s.served).collect();
    assert_eq!(
        got,
        [
            Served::Exact,
            Served::Exact,
            Served::Composed { recomputed: 1 },
            Served::Computed
        ]
    );
    assert_eq!(r.reused_tokens(&l), 3 + 6 + 1);
}

#[test]
fn a_missing_exact_entry_breaks_the_chain_after_it() {
    let e = enc(S);
    let mut c = ModuleCache::new(ModuleModel::hybrid(1, 10, 10), 10_000).unwrap();
    let id = c.register(&e).unwrap();
    let l = lay(&e, r#"<prompt schema="r"><sys/><doc/></prompt>"#);
    // Only the second segment's state: useless without the first.
    c.admit_exact(id, &l, 1).unwrap();
    assert_eq!(served(&mut c, id, &l, ReuseMode::Exact), ["miss", "miss"]);
}

#[test]
fn exact_entries_depend_on_the_run_before_them() {
    let e = enc(U);
    let mut c = ModuleCache::new(ModuleModel::hybrid(1, 10, 10), 10_000).unwrap();
    let id = c.register(&e).unwrap();
    let la = lay(&e, r#"<prompt schema="u"><a/></prompt>"#);
    let lb = lay(&e, r#"<prompt schema="u"><b/></prompt>"#);
    let lac = lay(&e, r#"<prompt schema="u"><a/><c/></prompt>"#);
    assert_eq!(la.segments.len(), 2); // Head, a
    for i in 0..2 {
        c.admit_exact(id, &la, i).unwrap();
    }
    assert_eq!(
        served(&mut c, id, &la, ReuseMode::Exact),
        ["exact", "exact"]
    );
    // Head is shared; b's state is not a's.
    assert_eq!(served(&mut c, id, &lb, ReuseMode::Exact), ["exact", "miss"]);
    // a ends at 7 where c starts: c is in the run, its exact entry absent.
    assert_eq!(
        served(&mut c, id, &lac, ReuseMode::Exact),
        ["exact", "exact", "miss"]
    );
}

#[test]
fn registering_beyond_the_budget_is_an_error_and_unpins_nothing() {
    let e = enc(S);
    let u = enc(U);
    // S takes 15 bytes, U 13 (4 + 3 + 2 + 4).
    let mut c = ModuleCache::new(ModuleModel::attention(1), 20).unwrap();
    let id = c.register(&e).unwrap();
    assert_eq!(
        c.register(&u),
        Err(StoreError::OverBudget {
            need: 13,
            pinned: 15,
            capacity: 20
        })
    );
    assert_eq!(c.stats().refused, 1);
    assert_eq!(c.stats().pinned_bytes, 15);
    c.unregister(id).unwrap();
    let uid = c.register(&u).unwrap();
    assert_eq!(c.stats().pinned_bytes, 13);
    assert_eq!(c.unregister(id), Err(StoreError::UnknownSchema(id)));
    c.unregister(uid).unwrap();
    assert_eq!(c.unregister(uid), Err(StoreError::UnknownSchema(uid)));
}

#[test]
fn unregistered_modules_stay_until_the_budget_needs_room() {
    let e = enc(S);
    let u = enc(U);
    let mut c = ModuleCache::new(ModuleModel::attention(1), 20).unwrap();
    let id = c.register(&e).unwrap();
    let sys = c.admit(id, named(&c, id, "sys")).unwrap();
    c.unregister(id).unwrap();
    let st = c.stats();
    assert_eq!((st.pinned_bytes, st.used_bytes, st.entries), (0, 3, 1));
    // Registered again: the same namespace, the entry is served at once.
    let id2 = c.register(&e).unwrap();
    let l = lay(&e, r#"<prompt schema="r"><sys/></prompt>"#);
    let r = c.lookup(id2, &l, ReuseMode::Attention).unwrap();
    assert_eq!(r.segments[0].entry, Some(sys));
    c.unregister(id2).unwrap();
    // U needs 13 and 3 are used by sys: 16 <= 20, nothing evicted.
    let uid = c.register(&u).unwrap();
    assert!(c.is_resident(sys));
    assert!(c.drain_evicted().is_empty());
    c.unregister(uid).unwrap();
    // S again (15) + U's nothing resident: fits. Then a bigger squeeze.
    let mut small = ModuleCache::new(ModuleModel::attention(1), 16).unwrap();
    let id = small.register(&e).unwrap();
    let sys = small.admit(id, named(&small, id, "sys")).unwrap();
    small.unregister(id).unwrap();
    small.register(&u).unwrap();
    // 13 pinned + 3 unpinned = 16: fits exactly.
    assert!(small.is_resident(sys));
    let mut tight = ModuleCache::new(ModuleModel::attention(1), 15).unwrap();
    let id = tight.register(&e).unwrap();
    let sys = tight.admit(id, named(&tight, id, "sys")).unwrap();
    tight.unregister(id).unwrap();
    tight.register(&u).unwrap();
    assert!(!tight.is_resident(sys));
    assert_eq!(tight.drain_evicted(), [sys]);
    assert_eq!(tight.stats().evictions, 1);
}

#[test]
fn eviction_prefers_low_flops_per_byte_and_old_entries() {
    let e = enc(S);
    let u = enc(U);
    let mut c = ModuleCache::new(ModuleModel::attention(1), 30).unwrap();
    let id = c.register(&e).unwrap();
    // Same efficiency (tokens per byte); sys used earlier than doc.
    let sys = c.admit(id, named(&c, id, "sys")).unwrap();
    let doc = c.admit(id, named(&c, id, "doc")).unwrap();
    c.unregister(id).unwrap();
    // 13 pinned + 9 unpinned = 22 <= 30: both stay.
    let uid = c.register(&u).unwrap();
    assert!(c.is_resident(sys) && c.is_resident(doc));
    // An exact entry of 12 bytes (state 10 + 2 tokens... attention: 4 tokens).
    let l = lay(&u, r#"<prompt schema="u"><c/></prompt>"#);
    // Head (0..4) is the run; its exact entry takes 4 bytes: 26 <= 30.
    c.admit_exact(uid, &l, 0).unwrap();
    assert!(c.is_resident(sys) && c.is_resident(doc));
    let la = lay(&u, r#"<prompt schema="u"><a/></prompt>"#);
    // 3 more: 29. Then one of 4 more would need 33: the oldest goes (sys).
    c.admit_exact(uid, &la, 1).unwrap();
    let lb = lay(&u, r#"<prompt schema="u"><b/></prompt>"#);
    c.admit_exact(uid, &lb, 1).unwrap(); // 2 bytes: 31 > 30, evict one.
    assert_eq!(c.drain_evicted(), [sys]);
    assert!(c.is_resident(doc));
    assert_eq!(
        c.admit_exact(uid, &lb, 5),
        Err(StoreError::NotInExactRun { segment: 5, run: 2 })
    );
}

#[test]
fn an_exact_entry_larger_than_the_unpinned_budget_is_refused() {
    let e = enc(S);
    let mut c = ModuleCache::new(ModuleModel::hybrid(1, 100, 0), 460).unwrap();
    let id = c.register(&e).unwrap(); // 15 + 4 * 100 = 415 pinned
    let l = lay(&e, r#"<prompt schema="r"><sys/></prompt>"#);
    assert_eq!(
        c.admit_exact(id, &l, 0),
        Err(StoreError::DoesNotFit {
            need: 103,
            unpinned: 45
        })
    );
    assert_eq!(c.stats().entries, 0);
}

#[test]
fn bad_arguments_are_errors() {
    let e = enc(S);
    let u = enc(U);
    assert_eq!(
        ModuleCache::new(ModuleModel::attention(1), 0).err(),
        Some(StoreError::ZeroCapacity)
    );
    assert_eq!(
        ModuleCache::new(ModuleModel::attention(0), 10).err(),
        Some(StoreError::ZeroKvBytes)
    );
    let mut c = ModuleCache::new(ModuleModel::attention(1), 100).unwrap();
    let id = c.register(&e).unwrap();
    assert_eq!(
        c.admit(id, ModuleRef::Anonymous(0)),
        Err(StoreError::UnknownModule(ModuleRef::Anonymous(0)))
    );
    assert_eq!(
        c.module_named(id, "nope"),
        Err(StoreError::NoModuleNamed("nope".into()))
    );
    assert_eq!(
        c.admit(SchemaId(99), ModuleRef::Anonymous(0)),
        Err(StoreError::UnknownSchema(SchemaId(99)))
    );
    // A layout of another schema.
    let l = lay(&u, r#"<prompt schema="u"><c/></prompt>"#);
    assert_eq!(
        c.lookup(id, &l, ReuseMode::Attention),
        Err(StoreError::ForeignLayout { segment: 0 })
    );
    // Registering twice counts twice.
    assert_eq!(c.register(&e).unwrap(), id);
    c.unregister(id).unwrap();
    assert_eq!(c.stats().schemas, 1);
    c.unregister(id).unwrap();
    assert_eq!(c.stats().schemas, 0);
}

#[test]
fn a_layout_past_the_last_position_is_foreign_not_a_panic() {
    let e = enc(S);
    let mut c = ModuleCache::new(ModuleModel::hybrid(1, 1, 1), 1000).unwrap();
    let id = c.register(&e).unwrap();
    let mut l = lay(&e, r#"<prompt schema="r">hi<sys/></prompt>"#);
    l.segments[0].start = u32::MAX;
    assert_eq!(
        c.lookup(id, &l, ReuseMode::Exact),
        Err(StoreError::ForeignLayout { segment: 0 })
    );
    assert_eq!(
        c.admit_exact(id, &l, 0),
        Err(StoreError::ForeignLayout { segment: 0 })
    );
}

#[derive(Clone, Debug)]
enum Op {
    Register(usize),
    Unregister(usize),
    Admit(usize, usize),
    AdmitExact(usize, usize, usize),
    Lookup(usize, usize, u8),
}

const PROMPTS_S: [&str; 4] = [
    r#"<prompt schema="r"><sys/><doc/><tail/>ask</prompt>"#,
    r#"<prompt schema="r"><sys/><q p="x"/><tail/></prompt>"#,
    r#"<prompt schema="r"><doc/><sys/></prompt>"#,
    r#"<prompt schema="r">hi<tail/></prompt>"#,
];
const PROMPTS_U: [&str; 4] = [
    r#"<prompt schema="u"><a/><c/></prompt>"#,
    r#"<prompt schema="u"><b/><c/>x</prompt>"#,
    r#"<prompt schema="u"><c/></prompt>"#,
    r#"<prompt schema="u">y<a/></prompt>"#,
];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2usize).prop_map(Op::Register),
        (0..2usize).prop_map(Op::Unregister),
        (0..2usize, 0..8usize).prop_map(|(s, m)| Op::Admit(s, m)),
        (0..2usize, 0..4usize, 0..4usize).prop_map(|(s, p, i)| Op::AdmitExact(s, p, i)),
        (0..2usize, 0..4usize, 0..3u8).prop_map(|(s, p, m)| Op::Lookup(s, p, m)),
    ]
}

fn any_segment() -> impl Strategy<Value = marconi_pml::Segment> {
    (
        0..4u8,
        proptest::option::of(0..6usize),
        any::<u32>(),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(k, m, start, len, cached)| marconi_pml::Segment {
            name: None,
            module: m.map(marconi_pml::ModuleId),
            kind: match k {
                0 => marconi_pml::SegmentKind::Module,
                1 => marconi_pml::SegmentKind::Anonymous,
                2 => marconi_pml::SegmentKind::Param,
                _ => marconi_pml::SegmentKind::Text,
            },
            start: start % 20,
            len: if len % 7 == 0 { len } else { len % 8 },
            cached,
            tokens: Vec::new(),
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any layout (as a C caller may build one) gets an answer or
    /// ForeignLayout, never a panic; nothing is admitted from a foreign one.
    #[test]
    fn arbitrary_layouts_never_panic(
        segs in proptest::collection::vec(any_segment(), 0..8),
        hybrid in any::<bool>(),
        at in 0..8usize,
    ) {
        let e = enc(U);
        let model = if hybrid { ModuleModel::hybrid(1, 3, 2) } else { ModuleModel::attention(1) };
        let mut c = ModuleCache::new(model, 1000).unwrap();
        let id = c.register(&e).unwrap();
        let l = Layout { segments: segs };
        for mode in [ReuseMode::Attention, ReuseMode::Exact, ReuseMode::Composed { window: 3 }] {
            match c.lookup(id, &l, mode) {
                Ok(r) => prop_assert_eq!(r.segments.len(), l.segments.len()),
                Err(StoreError::ForeignLayout { segment }) => prop_assert!(segment < l.segments.len()),
                Err(StoreError::ModeNotApplicable { .. }) => {}
                Err(other) => prop_assert!(false, "{}", other),
            }
        }
        let before = c.stats().entries;
        if c.admit_exact(id, &l, at).is_err() {
            prop_assert_eq!(c.stats().entries, before);
        }
        prop_assert_eq!(c.check_invariants(), Ok(()));
    }

    /// Never over budget; pinned entries never evicted; a lookup never
    /// reports an entry that is not resident; modes never mixed.
    #[test]
    fn invariants_hold_under_random_operations(
        hybrid in any::<bool>(),
        capacity in 1u64..400,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let encs = [enc(S), enc(U)];
        let layouts: Vec<Vec<Layout>> = vec![
            PROMPTS_S.iter().map(|p| lay(&encs[0], p)).collect(),
            PROMPTS_U.iter().map(|p| lay(&encs[1], p)).collect(),
        ];
        let model = if hybrid { ModuleModel::hybrid(2, 5, 3) } else { ModuleModel::attention(2) };
        let mut c = ModuleCache::new(model, capacity).unwrap();
        let mut ids: [Option<SchemaId>; 2] = [None, None];
        // Entries admitted as module entries of a registered schema.
        let mut pinned: Vec<(usize, marconi_pml::EntryId)> = Vec::new();
        for op in ops {
            match op {
                Op::Register(s) => {
                    if ids[s].is_none() {
                        if let Ok(id) = c.register(&encs[s]) {
                            ids[s] = Some(id);
                        }
                    }
                }
                Op::Unregister(s) => {
                    if let Some(id) = ids[s].take() {
                        c.unregister(id).unwrap();
                        pinned.retain(|(k, _)| *k != s);
                    }
                }
                Op::Admit(s, m) => {
                    if let Some(id) = ids[s] {
                        let n = encs[s].schema().modules().len();
                        let r = if m < n {
                            ModuleRef::Named(marconi_pml::ModuleId(m))
                        } else {
                            ModuleRef::Anonymous(m - n)
                        };
                        if let Ok(e) = c.admit(id, r) {
                            pinned.push((s, e));
                        }
                    }
                }
                Op::AdmitExact(s, p, i) => {
                    if let Some(id) = ids[s] {
                        let _ = c.admit_exact(id, &layouts[s][p], i);
                    }
                }
                Op::Lookup(s, p, m) => {
                    let Some(id) = ids[s] else { continue };
                    let mode = match m {
                        0 => ReuseMode::Attention,
                        1 => ReuseMode::Exact,
                        _ => ReuseMode::Composed { window: 2 },
                    };
                    let l = &layouts[s][p];
                    match c.lookup(id, l, mode) {
                        Err(StoreError::ModeNotApplicable { .. }) => {
                            prop_assert!(hybrid == (mode == ReuseMode::Attention));
                        }
                        Err(e) => prop_assert!(false, "lookup failed: {e}"),
                        Ok(r) => {
                            for (i, (g, seg)) in r.segments.iter().zip(&l.segments).enumerate() {
                                // Reported entries are resident, and only hits have one.
                                match g.entry {
                                    Some(e) => prop_assert!(g.served.is_hit() && c.is_resident(e)),
                                    None => prop_assert!(!g.served.is_hit()),
                                }
                                prop_assert_eq!(seg.cached, g.served != Served::Computed);
                                let ok = match (mode, g.served) {
                                    (_, Served::Computed | Served::Miss) => true,
                                    (ReuseMode::Attention, Served::Attention) => true,
                                    (ReuseMode::Exact, Served::Exact) => i < r.exact_run,
                                    (ReuseMode::Exact, Served::Recomputed) => i >= r.exact_run,
                                    (ReuseMode::Composed { .. }, Served::Exact) => i < r.exact_run,
                                    (ReuseMode::Composed { .. }, Served::Composed { .. }) => i >= r.exact_run,
                                    _ => false,
                                };
                                prop_assert!(ok, "mode {:?} served {:?} at {}", mode, g.served, i);
                            }
                        }
                    }
                }
            }
            prop_assert_eq!(c.check_invariants(), Ok(()));
            let st = c.stats();
            prop_assert!(st.used_bytes <= st.capacity_bytes);
            for (_, e) in &pinned {
                prop_assert!(c.is_resident(*e), "pinned entry {:?} evicted", e);
            }
        }
    }
}
