//! Position layouts checked against hand-computed expectations: one line
//! per segment, `kind name start+len cached|computed`.

use marconi_pml::{ByteTokenizer, Encoded, Layout, Prompt, Schema, Tokenizer};

/// One token per whitespace-separated word (ids are word lengths; only
/// counts matter here): the Figure 2 layout as a word-level tokenizer sees it.
struct Words;

impl Tokenizer for Words {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        text.split_whitespace().map(|w| w.len() as u32).collect()
    }
}

fn render(l: &Layout) -> String {
    l.segments
        .iter()
        .map(|s| {
            format!(
                "{} {} {}+{} {}\n",
                s.kind.as_str(),
                s.name.as_deref().unwrap_or("-"),
                s.start,
                s.len,
                if s.cached { "cached" } else { "computed" }
            )
        })
        .collect()
}

fn lay(schema: &str, prompt: &str, tok: &mut dyn Tokenizer) -> (Encoded, Layout) {
    let s = Schema::parse(schema).unwrap_or_else(|e| panic!("schema: {e}"));
    let enc = Encoded::new(s, tok).unwrap();
    let p = Prompt::parse(prompt, enc.schema()).unwrap_or_else(|e| panic!("prompt: {e}"));
    let l = enc
        .layout(&p, tok)
        .unwrap_or_else(|e| panic!("layout: {e}"));
    (enc, l)
}

#[track_caller]
fn check(schema: &str, prompt: &str, expect: &str) {
    let (_, l) = lay(schema, prompt, &mut ByteTokenizer);
    let want: String = expect
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(render(&l), want);
}

const FIG2_SCHEMA: &str = include_str!("fixtures/figure2_schema.xml");
const FIG2_PROMPT: &str = include_str!("fixtures/figure2_prompt.xml");

#[test]
fn figure2_word_tokens() {
    // trip-plan: "Plan a trip of" 0..4, duration 4..6, "." 6..7; the union
    // starts at 7 (tokyo: 7 words, miami: 6), so the schema spans 14.
    let (enc, l) = lay(FIG2_SCHEMA, FIG2_PROMPT, &mut Words);
    assert_eq!(enc.total(), 14);
    let tokyo = enc.schema().find("tokyo").unwrap();
    let miami = enc.schema().find("miami").unwrap();
    assert_eq!(enc.module_span(tokyo), (7, 7));
    assert_eq!(enc.module_span(miami), (7, 6));
    assert_eq!(
        render(&l),
        "module trip-plan 0+4 cached\n\
         param duration 4+2 computed\n\
         module trip-plan 6+1 cached\n\
         module miami 7+6 cached\n\
         text - 13+4 computed\n"
    );
    assert_eq!(l.cached_tokens(), 11);
    assert_eq!(l.computed_tokens(), 6);
    assert_eq!(
        l.position_ids(),
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    );
}

#[test]
fn figure2_bytes_argument_too_long() {
    // "3 days" is 6 bytes; duration reserves 2 positions.
    let s = Schema::parse(FIG2_SCHEMA).unwrap();
    let enc = Encoded::new(s, &mut ByteTokenizer).unwrap();
    let p = Prompt::parse(FIG2_PROMPT, enc.schema()).unwrap();
    let e = enc.layout(&p, &mut ByteTokenizer).unwrap_err();
    assert_eq!(
        e.to_string(),
        "2:14: argument for param 'duration' of module 'trip-plan' is 6 tokens; its len is 2"
    );
}

#[test]
fn module_encoding_has_placeholders() {
    let (enc, _) = lay(FIG2_SCHEMA, FIG2_PROMPT, &mut Words);
    let trip = enc.schema().find("trip-plan").unwrap();
    let segs: Vec<_> = enc
        .module_segments(trip)
        .iter()
        .map(|s| (s.kind.as_str(), s.start, s.len, s.tokens.len()))
        .collect();
    assert_eq!(
        segs,
        [("module", 0, 4, 4), ("param", 4, 2, 0), ("module", 6, 1, 1)]
    );
}

#[test]
fn nested_modules_roles_and_anonymous_text() {
    // By hand, bytes: "You plan trips." 0..15 (anonymous, in <system>);
    // travel-plan from 15: "Trip of " 15..23 (the space before the
    // parameter is text; the line break and indentation before "Trip"
    // are formatting), days 23..27, " days." 27..33, union at 33:
    // domestic 33..48 ("Home: " 6, city 8, "." 1), overseas 33..61
    // ("Abroad." 33..40, union at 40: tokyo 40..46, rome 40..52;
    // "Passport." 52..61); "End." 61..65; "Answer briefly." 65..80. The
    // prompt's text follows the anonymous text that no import follows.
    check(
        include_str!("fixtures/travel_schema.xml"),
        include_str!("fixtures/travel_prompt.xml"),
        "anonymous - 0+15 cached
         module travel-plan 15+8 cached
         param days 23+2 computed
         module travel-plan 27+6 cached
         module overseas 33+7 cached
         module rome 40+12 cached
         module overseas 52+9 cached
         module travel-plan 61+4 cached
         anonymous - 65+15 cached
         text - 80+9 computed",
    );
}

const S: &str = r#"<schema name="s">
  <module name="a">AAAA</module>
  <module name="b">BB<param name="p" len="5"/>B</module>
  <union>
    <module name="x">XXXXXX</module>
    <module name="y">YY</module>
  </union>
  <module name="z">ZZZ</module>
</schema>"#;

// a 0..4, b 4..7 with p at 6..11 and "B" 11..12, union 12..18, z 18..21.

#[test]
fn union_members_share_a_start_and_the_largest_counts() {
    check(
        S,
        r#"<prompt schema="s"><y/><z/></prompt>"#,
        "module y 12+2 cached
         module z 18+3 cached",
    );
    check(
        S,
        r#"<prompt schema="s"><x/><z/></prompt>"#,
        "module x 12+6 cached
         module z 18+3 cached",
    );
}

#[test]
fn text_starts_where_the_previous_segment_ends() {
    check(
        S,
        r#"<prompt schema="s">Q: <a/> mid <z/> end</prompt>"#,
        // The spaces around the imports are the prompt's text (no line
        // break: not formatting).
        "text - 0+3 computed
         module a 0+4 cached
         text - 4+5 computed
         module z 18+3 cached
         text - 21+4 computed",
    );
}

#[test]
fn arguments_take_the_reserved_positions() {
    check(
        S,
        r#"<prompt schema="s"><b p="hello"/>after</prompt>"#,
        "module b 4+2 cached
         param p 6+5 computed
         module b 11+1 cached
         text - 12+5 computed",
    );
    // Missing and empty arguments: a parameter segment of length 0.
    check(
        S,
        r#"<prompt schema="s"><b/></prompt>"#,
        "module b 4+2 cached
         param p 6+0 computed
         module b 11+1 cached",
    );
    check(
        S,
        r#"<prompt schema="s"><b p="  "/></prompt>"#,
        "module b 4+2 cached
         param p 6+0 computed
         module b 11+1 cached",
    );
    // Exactly len tokens fit.
    check(
        S,
        r#"<prompt schema="s"><b p="12345"/></prompt>"#,
        "module b 4+2 cached
         param p 6+5 computed
         module b 11+1 cached",
    );
}

#[test]
fn imports_keep_the_prompt_order_and_schema_positions() {
    check(
        S,
        r#"<prompt schema="s"><z/><a/></prompt>"#,
        "module z 18+3 cached
         module a 0+4 cached",
    );
}

#[test]
fn whitespace_is_trimmed_at_text_ends_only() {
    check(
        r#"<schema name="w"><module name="m">
              two  words
           </module></schema>"#,
        r#"<prompt schema="w">
              <m/>
              a
              b
           </prompt>"#,
        // "two  words" keeps its double space (10 bytes); "a\n  ...b"
        // keeps its inner newline and indentation (16 bytes).
        "module m 0+10 cached
         text - 10+17 computed",
    );
}

#[test]
fn anonymous_text_placement() {
    let schema = r#"<schema name="t">Intro<module name="a">AA</module>Mid<module name="b">B</module>Tail</schema>"#;
    // Intro 0..5, a 5..7, Mid 7..10, b 10..11, Tail 11..15.
    check(
        schema,
        r#"<prompt schema="t"><b/>q</prompt>"#,
        "anonymous - 0+5 cached
         anonymous - 7+3 cached
         module b 10+1 cached
         anonymous - 11+4 cached
         text - 15+1 computed",
    );
    check(
        schema,
        r#"<prompt schema="t">only text</prompt>"#,
        "anonymous - 0+5 cached
         anonymous - 7+3 cached
         anonymous - 11+4 cached
         text - 15+9 computed",
    );
    check(
        schema,
        r#"<prompt schema="t"><a/>q<b/></prompt>"#,
        "anonymous - 0+5 cached
         module a 5+2 cached
         text - 7+1 computed
         anonymous - 7+3 cached
         module b 10+1 cached
         anonymous - 11+4 cached",
    );
}

#[test]
fn entities_and_cdata_are_text() {
    check(
        r#"<schema name="e"><module name="m">a &lt; b<![CDATA[ <c> ]]></module></schema>"#,
        r#"<prompt schema="e"><m/>&amp;</prompt>"#,
        // "a < b" and " <c> " join and keep their spaces (no line break
        // around them): 10 bytes.
        "module m 0+10 cached
         text - 10+1 computed",
    );
}

#[test]
fn closures_are_tokenizers() {
    let mut chars = |t: &str| t.chars().map(u32::from).collect::<Vec<u32>>();
    let (_, l) = lay(
        r#"<schema name="u"><module name="m">héllo</module></schema>"#,
        r#"<prompt schema="u"><m/></prompt>"#,
        &mut chars,
    );
    assert_eq!(render(&l), "module m 0+5 cached\n");
}
