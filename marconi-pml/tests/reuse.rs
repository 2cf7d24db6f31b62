//! Reuse plans: which segments a lookup reuses, and how, per named mode.

use marconi_pml::{
    namespace, ByteTokenizer, Encoded, Layout, Prompt, Reuse, ReuseMode, ReusePlan, Schema,
};

// sys 0..3, doc 3..9, q 9..13 (p at 10..12), tail 13..15.
const S: &str = r#"<schema name="r">
  <module name="sys">SYS</module>
  <module name="doc">DOCDOC</module>
  <module name="q">Q<param name="p" len="2"/>Z</module>
  <module name="tail">TT</module>
</schema>"#;

fn lay(prompt: &str) -> (Encoded, Layout) {
    let enc = Encoded::new(Schema::parse(S).unwrap(), &mut ByteTokenizer).unwrap();
    let p = Prompt::parse(prompt, enc.schema()).unwrap();
    let l = enc.layout(&p, &mut ByteTokenizer).unwrap();
    (enc, l)
}

fn names(plan: &ReusePlan) -> Vec<&'static str> {
    plan.segments.iter().map(|r| r.as_str()).collect()
}

#[test]
fn modes_are_named_and_never_mixed() {
    let (_, l) = lay(r#"<prompt schema="r"><sys/><doc/><tail/>ask</prompt>"#);
    let exact = ReusePlan::new(&l, ReuseMode::Exact);
    assert_eq!(exact.exact_run, 2);
    assert_eq!(names(&exact), ["exact", "exact", "recomputed", "computed"]);
    assert_eq!(exact.reused_tokens(&l), 9);

    let composed = ReusePlan::new(&l, ReuseMode::Composed { window: 1 });
    assert_eq!(
        composed.segments,
        [
            Reuse::Exact,
            Reuse::Exact,
            Reuse::Composed { recomputed: 1 },
            Reuse::Computed
        ]
    );
    assert_eq!(composed.reused_tokens(&l), 10);

    let attention = ReusePlan::new(&l, ReuseMode::Attention);
    assert_eq!(
        names(&attention),
        ["attention", "attention", "attention", "computed"]
    );
    assert_eq!(attention.reused_tokens(&l), 11);
}

#[test]
fn the_exact_run_is_a_gapless_prefix_from_zero() {
    // Out of schema order: doc starts at 3, not 0.
    let (_, l) = lay(r#"<prompt schema="r"><doc/><sys/></prompt>"#);
    let p = ReusePlan::new(&l, ReuseMode::Exact);
    assert_eq!(
        (p.exact_run, names(&p)),
        (0, vec!["recomputed", "recomputed"])
    );
    // A gap (doc skipped) ends the run after sys.
    let (_, l) = lay(r#"<prompt schema="r"><sys/><tail/></prompt>"#);
    assert_eq!(ReusePlan::new(&l, ReuseMode::Exact).exact_run, 1);
    // Prompt text first: nothing is exact.
    let (_, l) = lay(r#"<prompt schema="r">hi<sys/></prompt>"#);
    assert_eq!(ReusePlan::new(&l, ReuseMode::Exact).exact_run, 0);
    // An argument ends the run: the cached state saw placeholders there.
    let (_, l) = lay(r#"<prompt schema="r"><sys/><doc/><q p="ab"/><tail/></prompt>"#);
    let p = ReusePlan::new(&l, ReuseMode::Exact);
    assert_eq!(p.exact_run, 3);
    assert_eq!(
        names(&p),
        [
            "exact",
            "exact",
            "exact",
            "computed",
            "recomputed",
            "recomputed"
        ]
    );
}

#[test]
fn modules_report_their_least_exact_segment() {
    let (enc, l) = lay(r#"<prompt schema="r"><sys/><q p="ab"/></prompt>"#);
    let p = ReusePlan::new(&l, ReuseMode::Composed { window: 4 });
    let got: Vec<(String, Reuse)> = p
        .modules(&l)
        .into_iter()
        .map(|(m, r)| (enc.schema().module(m).name.clone(), r))
        .collect();
    // q's segments are 1 token each: the window is capped at the length.
    assert_eq!(
        got,
        [
            ("sys".to_string(), Reuse::Exact),
            ("q".to_string(), Reuse::Composed { recomputed: 1 })
        ]
    );
    assert_eq!(p.reused_tokens(&l), 3);
}

#[test]
fn exact_prefix_is_a_prefix_cache_request() {
    let (enc, l) = lay(r#"<prompt schema="r"><sys/><doc/><tail/></prompt>"#);
    let p = ReusePlan::new(&l, ReuseMode::Exact);
    let (tokens, ends) = p.exact_prefix(&l);
    assert_eq!(tokens, b"SYSDOCDOC".map(u32::from));
    assert_eq!(ends, [3, 9]);
    let ns = namespace(&enc);
    let again = Encoded::new(Schema::parse(S).unwrap(), &mut ByteTokenizer).unwrap();
    assert_eq!(namespace(&again), ns);
    let other = Encoded::new(
        Schema::parse(&S.replace("DOCDOC", "DOCDOX")).unwrap(),
        &mut ByteTokenizer,
    )
    .unwrap();
    assert_ne!(namespace(&other), ns);
}
