//! What XML 1.0 makes an error is one (a character reference or character
//! that is not a `Char`), and only formatting whitespace is dropped: the
//! indentation and line breaks around elements go, the spaces that separate
//! words from a parameter's argument stay, so positions follow Prompt
//! Cache §3.3 (a module starts where the tokens before it end).

use marconi_pml::{ByteTokenizer, Encoded, Prompt, Schema, Tokenizer};

#[track_caller]
fn schema_err(schema: &str, want: &str) {
    let e = Schema::parse(schema).expect_err("schema must fail");
    assert!(e.to_string().contains(want), "{e} does not say {want:?}");
}

#[test]
fn non_characters_are_refused_with_their_place() {
    for (r, name) in [
        ("&#xD800;", "&#xD800;"),
        ("&#xDFFF;", "&#xDFFF;"),
        ("&#x110000;", "&#x110000;"),
        ("&#xFFFE;", "&#xFFFE;"),
        ("&#xFFFF;", "&#xFFFF;"),
        ("&#1;", "&#1;"),
        ("&#x1F;", "&#x1F;"),
        ("&#55296;", "&#55296;"),
        ("&#99999999999;", "&#99999999999;"),
        ("&#0;", "&#0;"),
    ] {
        let doc = format!("<schema name='s'>\n  <module name='a'>x{r}y</module></schema>");
        let e = Schema::parse(&doc).expect_err(r);
        let msg = e.to_string();
        assert!(
            msg.starts_with("2:21: malformed XML: the character reference ")
                && msg.contains(name)
                && msg.contains("is not a character XML 1.0 allows"),
            "{r}: {msg}"
        );
    }
    // In an attribute value too, and a raw control character.
    schema_err(
        "<schema name='s&#xD800;'/>",
        "1:16: malformed XML: the character reference &#xD800;",
    );
    schema_err(
        "<schema name='s'><module name='a'>x\u{1}</module></schema>",
        "1:36: malformed XML: the character U+0001",
    );
    schema_err(
        "<schema name='s'><module name='a'>\u{FFFF}</module></schema>",
        "malformed XML: the character U+FFFF",
    );
    // A prompt is checked the same way.
    let s = Schema::parse("<schema name='s'><module name='a'>x</module></schema>").unwrap();
    let e = Prompt::parse("<prompt schema='s'><a/>&#x110000;</prompt>", &s).expect_err("prompt");
    assert!(e.to_string().contains("&#x110000;"), "{e}");
    // Characters XML allows, and references in comments and CDATA (literal
    // text there), are fine.
    for ok in [
        "&#x9;&#xA;&#xD;&#x20;&#xD7FF;&#xE000;&#xFFFD;&#x10000;&#x10FFFF;&#65;",
        "<!-- &#xD800; --> x",
        "<![CDATA[&#xD800;]]>",
        "\u{10FFFF}\u{E000}",
    ] {
        let doc = format!("<schema name='s'><module name='a'>{ok}</module></schema>");
        Schema::parse(&doc).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
}

/// The texts the byte tokenizer sees, with their positions.
fn texts(schema: &str, prompt: &str) -> Vec<(String, u32, u32)> {
    let s = Schema::parse(schema).unwrap_or_else(|e| panic!("schema: {e}"));
    let enc = Encoded::new(s, &mut ByteTokenizer).unwrap();
    let p = Prompt::parse(prompt, enc.schema()).unwrap_or_else(|e| panic!("prompt: {e}"));
    let l = enc.layout(&p, &mut ByteTokenizer).unwrap();
    l.segments
        .iter()
        .map(|g| {
            let text = String::from_utf8(g.tokens.iter().map(|&t| t as u8).collect()).unwrap();
            (text, g.start, g.len)
        })
        .collect()
}

#[test]
fn words_around_a_parameter_keep_their_spaces() {
    let schema = "<schema name='s'>
  <module name='plan'>
    Plan a trip for <param name='days' len='4'/> days.
  </module>
  <module name='city'>Miami is in Florida.</module>
</schema>";
    let prompt = "<prompt schema='s'>
  <plan days='3'/>
  <city/>
  What to see?
</prompt>";
    let got = texts(schema, prompt);
    // "Plan a trip for " is 16 bytes, the parameter 4 positions, " days."
    // 6: the module spans 26 positions and `city` starts at 26 (§3.3).
    assert_eq!(
        got,
        vec![
            ("Plan a trip for ".to_string(), 0, 16),
            ("3".to_string(), 16, 1),
            (" days.".to_string(), 20, 6),
            ("Miami is in Florida.".to_string(), 26, 20),
            ("What to see?".to_string(), 46, 12),
        ]
    );
    let joined: String = got.iter().map(|t| t.0.as_str()).collect();
    assert!(joined.contains("for 3 days."), "{joined}");
}

/// One token per run of letters, one per other non-space character, and
/// one per space: a tokenizer for which dropped spaces move positions.
struct Pieces;

impl Tokenizer for Pieces {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut in_word = false;
        for c in text.chars() {
            if c.is_alphanumeric() {
                if !in_word {
                    out.push(1);
                }
                in_word = true;
            } else {
                out.push(c as u32);
                in_word = false;
            }
        }
        out
    }
}

#[test]
fn module_and_parameter_positions_follow_section_3_3() {
    // Each module starts where the tokens of the modules before it end; a
    // union's members start together and the union spans its largest.
    let schema = "<schema name='s'>
  <module name='a'>Hello <param name='who' len='3'/>, welcome.</module>
  <union>
    <module name='b'>Go to <param name='where' len='2'/> now</module>
    <module name='c'>Stay</module>
  </union>
  <module name='d'>Bye</module>
</schema>";
    let s = Schema::parse(schema).unwrap();
    let enc = Encoded::new(s, &mut Pieces).unwrap();
    let p = Prompt::parse(
        "<prompt schema='s'><a who='you'/><b where='Rome'/><d/></prompt>",
        enc.schema(),
    )
    .unwrap();
    let l = enc.layout(&p, &mut Pieces).unwrap();
    let got: Vec<(String, u32, u32)> = l
        .segments
        .iter()
        .map(|g| {
            (
                format!("{} {}", g.kind.as_str(), g.name.as_deref().unwrap_or("-")),
                g.start,
                g.len,
            )
        })
        .collect();
    // a: "Hello " = 2 tokens, who 3 positions, ", welcome." = 4 ("," " "
    // "welcome" ".") -> a spans 0..9. b: "Go to " = 4, where 2, " now" = 2
    // -> 8; c: 1; the union spans 9..17. d starts at 17.
    assert_eq!(
        got,
        vec![
            ("module a".to_string(), 0, 2),
            ("param who".to_string(), 2, 1),
            ("module a".to_string(), 5, 4),
            ("module b".to_string(), 9, 4),
            ("param where".to_string(), 13, 1),
            ("module b".to_string(), 15, 2),
            ("module d".to_string(), 17, 1),
        ]
    );
}

#[test]
fn formatting_whitespace_alone_is_dropped() {
    // Indentation and line breaks between elements and at a module's ends
    // never become text; a lone space between two arguments' modules would.
    let schema = "<schema name='s'>\n\t<module name='a'>\n\t\tA\n\t</module>\n\t<module name='b'>B</module>\n</schema>";
    let got = texts(schema, "<prompt schema='s'>\n  <a/>\n  <b/>\n</prompt>");
    assert_eq!(got, vec![("A".to_string(), 0, 1), ("B".to_string(), 1, 1)]);
    // Text on the line of its tag keeps its inner spaces.
    let got = texts(
        "<schema name='s'><module name='a'>x  y</module></schema>",
        "<prompt schema='s'><a/> tail </prompt>",
    );
    assert_eq!(
        got,
        vec![("x  y".to_string(), 0, 4), (" tail ".to_string(), 4, 6)]
    );
}
