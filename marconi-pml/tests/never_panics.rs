//! Arbitrary input never panics; inputs built from PML fragments, when they
//! parse, lay out inside the positions the schema fixes.

use marconi_pml::{ByteTokenizer, Encoded, Item, Prompt, Schema, SegmentKind};
use proptest::prelude::*;

fn schema_soup() -> impl Strategy<Value = String> {
    let frag = prop_oneof![
        Just("<module name=\"a\">".to_string()),
        Just("<module name=\"b\">".to_string()),
        Just("<module name=\"c\">".to_string()),
        Just("</module>".to_string()),
        Just("<union>".to_string()),
        Just("</union>".to_string()),
        Just("<user>".to_string()),
        Just("</user>".to_string()),
        "<param name=\"[pq]\" len=\"[0-9]{1,3}\"/>",
        "[a-z &<>;]{0,6}",
    ];
    prop::collection::vec(frag, 0..24)
        .prop_map(|v| format!("<schema name=\"s\">{}</schema>", v.concat()))
}

fn prompt_soup() -> impl Strategy<Value = String> {
    let frag = prop_oneof![
        Just("<a>".to_string()),
        Just("</a>".to_string()),
        Just("<b/>".to_string()),
        "<c p=\"[a-z ]{0,8}\"/>",
        "<a q=\"[a-z]{0,4}\"/>",
        Just("<user>".to_string()),
        Just("</user>".to_string()),
        "[a-z ]{0,6}",
    ];
    prop::collection::vec(frag, 0..12)
        .prop_map(|v| format!("<prompt schema=\"s\">{}</prompt>", v.concat()))
}

/// Builds a well-formed schema and a prompt of it from a byte string:
/// every byte a choice, so proptest explores and shrinks the structure.
struct Build<'a> {
    bytes: &'a [u8],
    at: usize,
    modules: usize,
}

/// A module as the builder made it: its name, its parameters' names and
/// lens, its nested modules grouped as unions (a group of one is a plain
/// nested module).
struct Made {
    name: String,
    params: Vec<(String, u32)>,
    groups: Vec<Vec<Made>>,
}

impl Build<'_> {
    fn next(&mut self) -> u8 {
        let b = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    /// One to six letters, a space in the middle when the first byte is odd.
    fn text(&mut self) -> String {
        let n = self.next() % 6 + 1;
        let mut t: String = (0..n)
            .map(|_| char::from(b'a' + self.next() % 26))
            .collect();
        if n % 2 == 1 && n > 1 {
            t.insert(1, ' ');
        }
        t
    }

    /// Items at `depth`; modules go to `out` (groups).
    fn body(
        &mut self,
        depth: u32,
        in_module: bool,
        xml: &mut String,
        out: &mut Vec<Vec<Made>>,
        params: &mut Vec<(String, u32)>,
    ) {
        let n = self.next() % 4;
        for _ in 0..n {
            match self.next() % 5 {
                0 | 1 => xml.push_str(&self.text()),
                2 if in_module => {
                    let name = format!("p{}", params.len());
                    let len = u32::from(self.next() % 6) + 1;
                    xml.push_str(&format!("<param name=\"{name}\" len=\"{len}\"/>"));
                    params.push((name, len));
                }
                3 if depth < 3 && self.modules < 12 => {
                    let m = self.module(depth + 1, xml);
                    out.push(vec![m]);
                }
                4 if depth < 3 && self.modules < 12 => {
                    xml.push_str("<union>");
                    let k = self.next() % 3 + 1;
                    let group = (0..k).map(|_| self.module(depth + 1, xml)).collect();
                    xml.push_str("</union>");
                    out.push(group);
                }
                _ => xml.push(' '),
            }
        }
    }

    fn module(&mut self, depth: u32, xml: &mut String) -> Made {
        let name = format!("m{}", self.modules);
        self.modules += 1;
        xml.push_str(&format!("<module name=\"{name}\">"));
        let (mut groups, mut params) = (Vec::new(), Vec::new());
        self.body(depth, true, xml, &mut groups, &mut params);
        xml.push_str("</module>");
        Made {
            name,
            params,
            groups,
        }
    }

    fn import(&mut self, m: &Made, xml: &mut String) {
        xml.push('<');
        xml.push_str(&m.name);
        for (p, len) in &m.params {
            if self.next() % 3 != 0 {
                // Sometimes one byte too long.
                let n = (u32::from(self.next()) % (len + 1)) as usize
                    + usize::from(self.next() % 16 == 0);
                xml.push_str(&format!(" {p}=\"{}\"", "v".repeat(n)));
            }
        }
        xml.push('>');
        self.imports(&m.groups, xml);
        xml.push_str(&format!("</{}>", m.name));
    }

    fn imports(&mut self, groups: &[Vec<Made>], xml: &mut String) {
        for g in groups {
            let pick = usize::from(self.next()) % (g.len() + 1);
            if let Some(m) = g.get(pick) {
                self.import(m, xml);
            }
        }
    }
}

fn built(bytes: &[u8]) -> (String, String) {
    let mut b = Build {
        bytes,
        at: 0,
        modules: 0,
    };
    let mut schema = String::from("<schema name=\"s\">");
    let mut groups = Vec::new();
    b.body(0, false, &mut schema, &mut groups, &mut Vec::new());
    schema.push_str("</schema>");
    let mut prompt = String::from("<prompt schema=\"s\">");
    if b.next() % 2 == 0 {
        prompt.push_str(&b.text());
    }
    b.imports(&groups, &mut prompt);
    prompt.push_str(&b.text());
    prompt.push_str("</prompt>");
    (schema, prompt)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_text_never_panics(s in ".{0,200}") {
        let _ = Schema::parse(&s);
        if let Ok(schema) = Schema::parse("<schema name='s'><module name='a'/></schema>") {
            let _ = Prompt::parse(&s, &schema);
        }
    }

    #[test]
    fn fragments_lay_out_inside_the_schema(schema in schema_soup(), prompt in prompt_soup()) {
        laid_out_inside(&schema, &prompt)?;
    }

    #[test]
    fn built_schemas_lay_out_inside_the_schema(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let (schema, prompt) = built(&bytes);
        Schema::parse(&schema).map_err(|e| TestCaseError::fail(format!("{e}: {schema}")))?;
        laid_out_inside(&schema, &prompt)?;
    }
}

fn laid_out_inside(schema: &str, prompt: &str) -> Result<(), TestCaseError> {
    {
        let Ok(s) = Schema::parse(schema) else {
            return Ok(());
        };
        let enc = Encoded::new(s, &mut ByteTokenizer).expect("small schemas fit in u32");
        let sch = enc.schema();
        // Union members share a start; a module lies inside the schema.
        for m in sch.modules() {
            for it in &m.body {
                if let Item::Union { members, .. } = it {
                    let starts: Vec<u32> = members.iter().map(|&x| enc.module_span(x).0).collect();
                    prop_assert!(starts.windows(2).all(|w| w[0] == w[1]));
                }
            }
        }
        for i in 0..sch.modules().len() {
            let (start, len) = enc.module_span(marconi_pml::ModuleId(i));
            prop_assert!(u64::from(start) + u64::from(len) <= u64::from(enc.total()));
        }
        let Ok(p) = Prompt::parse(prompt, sch) else {
            return Ok(());
        };
        let Ok(l) = enc.layout(&p, &mut ByteTokenizer) else {
            return Ok(());
        };
        for seg in &l.segments {
            prop_assert_eq!(seg.len as usize, seg.tokens.len());
            match seg.kind {
                SegmentKind::Module | SegmentKind::Param => {
                    let (start, len) = enc.module_span(seg.module.unwrap());
                    prop_assert!(seg.start >= start && seg.end() <= start + len);
                    prop_assert_eq!(seg.cached, seg.kind == SegmentKind::Module);
                }
                SegmentKind::Anonymous => prop_assert!(seg.cached && seg.end() <= enc.total()),
                SegmentKind::Text => prop_assert!(!seg.cached),
            }
        }
        prop_assert_eq!(
            l.position_ids().len() as u64,
            l.cached_tokens() + l.computed_tokens()
        );
    }
    Ok(())
}
