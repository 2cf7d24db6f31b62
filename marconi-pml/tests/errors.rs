//! Every error names its line and column and what was expected.

use marconi_pml::{ByteTokenizer, Encoded, Prompt, Schema};

#[track_caller]
fn schema_err(schema: &str, want: &str) {
    let e = Schema::parse(schema).expect_err("schema must fail");
    assert_eq!(e.to_string(), want);
}

#[track_caller]
fn prompt_err(schema: &str, prompt: &str, want: &str) {
    let s = Schema::parse(schema).unwrap_or_else(|e| panic!("schema: {e}"));
    let enc = Encoded::new(s, &mut ByteTokenizer).unwrap();
    let e = match Prompt::parse(prompt, enc.schema()) {
        Err(e) => e,
        Ok(p) => enc
            .layout(&p, &mut ByteTokenizer)
            .expect_err("prompt must fail"),
    };
    assert_eq!(e.to_string(), want);
}

#[test]
fn schema_errors() {
    schema_err(
        "<schema name='s'><module name='a'>x</schema>",
        "1:36: malformed XML: expected 'module' tag, not 'schema'",
    );
    schema_err(
        "",
        "1:1: malformed XML: the document does not have a root node",
    );
    schema_err(
        "<prompt schema='s'/>",
        "1:1: root element is <prompt>; expected <schema>",
    );
    schema_err("<schema/>", "1:1: <schema> needs the attribute 'name'");
    schema_err(
        "<schema name='s' version='2'/>",
        "1:18: unknown attribute 'version' on <schema>; expected name",
    );
    schema_err(
        "<schema name='s'>\n  <modul name='a'/>\n</schema>",
        "2:3: unknown element <modul> in <schema>; expected <module>, <union>, <system>, <user>, <assistant> or text",
    );
    schema_err(
        "<schema name='s'><module name='a'><b/></module></schema>",
        "1:35: unknown element <b> in module 'a'; expected <module>, <union>, <param>, <system>, <user>, <assistant> or text",
    );
    schema_err(
        "<schema name='s'><module name='a'/>\n<module name='a'/></schema>",
        "2:9: module 'a' is defined twice (first at 1:18)",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='0'/></module></schema>",
        "1:51: len=\"0\" of param 'p' is not a positive integer",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='-3'/></module></schema>",
        "1:51: len=\"-3\" of param 'p' is not a positive integer",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='two'/></module></schema>",
        "1:51: len=\"two\" of param 'p' is not a positive integer",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='99999999999'/></module></schema>",
        "1:51: len=\"99999999999\" of param 'p' is not a positive integer",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p'/></module></schema>",
        "1:35: <param> needs the attribute 'len'",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='1'/><param name='p' len='2'/></module></schema>",
        "1:67: param 'p' is defined twice in module 'a' (first at 1:35)",
    );
    schema_err(
        "<schema name='s'><param name='p' len='1'/></schema>",
        "1:18: <param name=\"p\"> outside a module; a parameter belongs to the <module> around it",
    );
    schema_err(
        "<schema name='s'><union>x<module name='a'/></union></schema>",
        "1:25: text inside <union>; expected only <module> elements there",
    );
    schema_err(
        "<schema name='s'><union> </union></schema>",
        "1:18: <union> has no <module>; expected at least one",
    );
    schema_err(
        "<schema name='s'><union><param name='p' len='1'/></union></schema>",
        "1:25: unknown element <param> in <union>; expected <module>",
    );
    schema_err(
        "<schema name='s'><module name='union'/></schema>",
        "1:26: invalid module name 'union': it is a PML tag",
    );
    schema_err(
        "<schema name='s'><module name='a b'/></schema>",
        "1:26: invalid module name 'a b': only ASCII letters, digits, '_', '-' and '.' may follow",
    );
    schema_err(
        "<schema name='s'><module name='9a'/></schema>",
        "1:26: invalid module name '9a': must start with an ASCII letter or '_'",
    );
    schema_err(
        "<schema name='s'><user><system>x</system></user></schema>",
        "1:24: <system> inside <user>; role tags do not nest",
    );
    schema_err(
        "<schema name='s'><module name='a'><param name='p' len='1'>x</param></module></schema>",
        "1:35: <param> must be empty",
    );
    schema_err(
        "<!DOCTYPE s [<!ENTITY a 'x'>]><schema name='s'/>",
        "1:1: malformed XML: XML with DTD detected",
    );
}

const S: &str = "<schema name='s'>
  <module name='a'>A<param name='p' len='3'/></module>
  <union><module name='x'>X<module name='inner'>I</module></module><module name='y'>Y</module></union>
</schema>";

#[test]
fn prompt_errors() {
    prompt_err(
        S,
        "<prompt schema='t'/>",
        "1:9: prompt uses schema 't' but the schema given is 's'",
    );
    prompt_err(S, "<prompt/>", "1:1: <prompt> needs the attribute 'schema'");
    prompt_err(
        S,
        "<schema name='s'/>",
        "1:1: root element is <schema>; expected <prompt>",
    );
    prompt_err(
        S,
        "<prompt schema='s'>\n  <b/>\n</prompt>",
        "2:3: unknown module 'b' in schema 's'; expected one of: <a>, <x>, <y>, <system>, <user>, <assistant> or text",
    );
    prompt_err(
        S,
        "<prompt schema='s'><x/><y/></prompt>",
        "1:24: modules 'x' and 'y' are members of one <union>; import at most one",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a/><a/></prompt>",
        "1:24: module 'a' is imported twice (first at 1:20)",
    );
    prompt_err(
        S,
        "<prompt schema='s'><inner/></prompt>",
        "1:20: module 'inner' is imported at the top level of the prompt; import it directly inside <x>",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a><inner/></a></prompt>",
        "1:23: module 'inner' is imported directly inside <a>; import it directly inside <x>",
    );
    prompt_err(
        S,
        "<prompt schema='s'><x><a/></x></prompt>",
        "1:23: module 'a' is imported directly inside <x>; import it at the top level of the prompt",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a><zz/></a></prompt>",
        "1:23: unknown module 'zz' in schema 's'; expected one of: nothing (it has no nested modules)",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a q='1'/></prompt>",
        "1:23: module 'a' has no param 'q'; expected p",
    );
    prompt_err(
        S,
        "<prompt schema='s'><y q='1'/></prompt>",
        "1:23: module 'y' has no param 'q'; expected none (it has no parameters)",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a p='four'/></prompt>",
        "1:23: argument for param 'p' of module 'a' is 4 tokens; its len is 3",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a>hi</a></prompt>",
        "1:23: text inside the import of module 'a'; put prompt text before or after <a>",
    );
    prompt_err(
        S,
        "<prompt schema='s' lang='en'/>",
        "1:20: unknown attribute 'lang' on <prompt>; expected schema",
    );
    prompt_err(
        S,
        "<prompt schema='s'><a></prompt>",
        "1:23: malformed XML: expected 'a' tag, not 'prompt'",
    );
}

#[test]
fn unknown_schema_in_a_registry() {
    let e = Prompt::parse_with("<prompt schema='nope'/>", |_| None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "1:9: prompt uses schema 'nope', which is not registered"
    );
}

#[test]
fn position_overflow_is_an_error() {
    let big = u32::MAX / 2 + 1;
    let s = format!(
        "<schema name='o'><module name='a'><param name='p' len='{big}'/></module><module name='b'><param name='q' len='{big}'/></module></schema>"
    );
    let schema = Schema::parse(&s).unwrap();
    let e = Encoded::new(schema, &mut ByteTokenizer).unwrap_err();
    assert_eq!(
        e.to_string(),
        "1:95: the layout needs more than 4294967295 position ids"
    );
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let n = 20_000;
    let mut s = String::from("<schema name='d'>");
    for i in 0..n {
        s.push_str(&format!("<module name='m{i}'>"));
    }
    s.push_str(&"</module>".repeat(n));
    s.push_str("</schema>");
    let e = Schema::parse(&s).unwrap_err();
    assert_eq!(
        e.to_string(),
        "1:616: modules nested deeper than 32; expected at most 32 levels"
    );
    let mut u = String::from("<schema name='u'>");
    for i in 0..n {
        u.push_str(&format!("<union><module name='m{i}'>"));
    }
    u.push_str(&"</module></union>".repeat(n));
    u.push_str("</schema>");
    assert!(Schema::parse(&u).is_err());
    // Deep elements that are not modules fail on the first one.
    let e = Schema::parse(&format!(
        "<schema name='x'>{}</schema>",
        "<a>".repeat(n) + &"</a>".repeat(n)
    ))
    .unwrap_err();
    assert!(
        e.to_string().starts_with("1:18: unknown element <a>"),
        "{e}"
    );
    let schema = Schema::parse("<schema name='p'><module name='a'/></schema>").unwrap();
    let deep = format!(
        "<prompt schema='p'>{}</prompt>",
        "<a>".repeat(n) + &"</a>".repeat(n)
    );
    assert!(Prompt::parse(&deep, &schema).is_err());
}

#[test]
fn the_deepest_nesting_allowed_lays_out() {
    let n = marconi_pml::MAX_DEPTH as usize;
    let open: String = (0..n).map(|i| format!("<module name='m{i}'>x")).collect();
    let schema = format!("<schema name='d'>{open}{}</schema>", "</module>".repeat(n));
    let enc = Encoded::new(Schema::parse(&schema).unwrap(), &mut ByteTokenizer).unwrap();
    let imports: String = (0..n).map(|i| format!("<m{i}>")).collect();
    let close: String = (0..n).rev().map(|i| format!("</m{i}>")).collect();
    let p = Prompt::parse(
        &format!("<prompt schema='d'>{imports}{close}</prompt>"),
        enc.schema(),
    )
    .unwrap();
    let l = enc.layout(&p, &mut ByteTokenizer).unwrap();
    assert_eq!(l.position_ids(), (0..n as u32).collect::<Vec<_>>());
}

#[test]
fn the_deepest_nesting_fits_a_small_thread_stack() {
    // Engines run requests on threads with small stacks; 32 levels of
    // parsing, encoding and layout fit in 256 KiB.
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(the_deepest_nesting_allowed_lays_out)
        .unwrap()
        .join()
        .unwrap();
}
