//! What schema and prompt parsing share: positions, attribute checks, text
//! normalisation and names.

use roxmltree::{Document, Node, ParsingOptions};

use crate::error::{Error, ErrorKind, Pos, Result};

/// The role tags (§3.2.3): transparent containers in a layout.
pub(crate) const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Tags a module may not be named after (a prompt imports modules by
/// element name).
const RESERVED: [&str; 8] = [
    "schema",
    "prompt",
    "module",
    "union",
    "param",
    "system",
    "user",
    "assistant",
];

/// The most nodes a document may hold (memory bound on hostile input).
const NODES_LIMIT: u32 = 1 << 20;

pub(crate) fn parse(text: &str) -> Result<Document<'_>> {
    check_chars(text)?;
    let opt = ParsingOptions {
        allow_dtd: false,
        nodes_limit: NODES_LIMIT,
        ..ParsingOptions::default()
    };
    Document::parse_with_options(text, opt).map_err(|e| Error::xml(&e))
}

/// Whether `c` is a `Char` of XML 1.0 (§2.2): #x9 | #xA | #xD |
/// [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF].
pub(crate) fn is_xml_char(c: u32) -> bool {
    matches!(c, 0x9 | 0xA | 0xD | 0x20..=0xD7FF | 0xE000..=0xFFFD | 0x1_0000..=0x10_FFFF)
}

/// The 1-based line and column (in characters) of byte `at` of `text`.
fn pos_in(text: &str, at: usize) -> Pos {
    let before = &text[..at];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Pos {
        line: u32::try_from(before.matches('\n').count() + 1).unwrap_or(u32::MAX),
        col: u32::try_from(before[line_start..].chars().count() + 1).unwrap_or(u32::MAX),
    }
}

/// Refuses what XML 1.0 makes a well-formedness error but the parser would
/// let through (as U+FFFD or as is): a character that is not a `Char`,
/// written as is or as a character reference (`&#xD800;`, `&#x110000;`,
/// `&#xFFFE;`, `&#1;`). References are read where XML reads them (not in
/// comments, CDATA sections or processing instructions, whose text is
/// literal).
fn check_chars(text: &str) -> Result<()> {
    let bad = |at: usize, what: String| {
        Err(Error::new(
            pos_in(text, at),
            ErrorKind::Xml(format!(
                "{what} is not a character XML 1.0 allows (#x9, #xA, #xD, #x20-#xD7FF, #xE000-#xFFFD, #x10000-#x10FFFF)"
            )),
        ))
    };
    if let Some((at, c)) = text.char_indices().find(|&(_, c)| !is_xml_char(c as u32)) {
        return bad(at, format!("the character U+{:04X}", c as u32));
    }
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let skip_to = |end: &[u8]| {
            rest.windows(end.len())
                .position(|w| w == end)
                .map_or(b.len(), |k| i + k + end.len())
        };
        if rest.starts_with(b"<!--") {
            i = skip_to(b"-->");
        } else if rest.starts_with(b"<![CDATA[") {
            i = skip_to(b"]]>");
        } else if rest.starts_with(b"<?") {
            i = skip_to(b"?>");
        } else if rest.starts_with(b"&#") {
            let end = rest.iter().position(|&c| c == b';').unwrap_or(rest.len());
            let body = &text[i + 2..i + end];
            let value = match body.strip_prefix('x') {
                Some(hex) if !hex.is_empty() && hex.bytes().all(|c| c.is_ascii_hexdigit()) => {
                    u32::from_str_radix(hex, 16).ok()
                }
                None if !body.is_empty() && body.bytes().all(|c| c.is_ascii_digit()) => {
                    body.parse::<u32>().ok()
                }
                // Malformed: the parser reports it.
                _ => Some(0x20),
            };
            match value {
                Some(v) if is_xml_char(v) => {}
                _ => return bad(i, format!("the character reference &#{body};")),
            }
            i += end.max(1);
        } else {
            i += 1;
        }
    }
    Ok(())
}

pub(crate) fn pos_at(doc: &Document<'_>, byte: usize) -> Pos {
    let p = doc.text_pos_at(byte);
    Pos {
        line: p.row,
        col: p.col,
    }
}

pub(crate) fn node_pos(n: Node<'_, '_>) -> Pos {
    pos_at(n.document(), n.range().start)
}

/// The element's name as written, namespace prefix included where it has
/// one (PML uses none, so a prefixed element is always unknown).
pub(crate) fn tag(n: Node<'_, '_>) -> String {
    match n.tag_name().namespace() {
        Some(ns) => format!("{{{ns}}}{}", n.tag_name().name()),
        None => n.tag_name().name().to_string(),
    }
}

/// Fails on the first attribute not in `allowed`.
pub(crate) fn check_attrs(n: Node<'_, '_>, allowed: &[&str]) -> Result<()> {
    for a in n.attributes() {
        if a.namespace().is_some() || !allowed.contains(&a.name()) {
            let expected = if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            };
            return Err(Error::new(
                pos_at(n.document(), a.range().start),
                ErrorKind::UnknownAttribute {
                    element: tag(n),
                    attr: a.name().to_string(),
                    expected,
                },
            ));
        }
    }
    Ok(())
}

pub(crate) fn required<'a>(n: Node<'a, '_>, attr: &'static str) -> Result<&'a str> {
    n.attribute(attr).ok_or_else(|| {
        Error::new(
            node_pos(n),
            ErrorKind::MissingAttribute {
                element: tag(n),
                attr,
            },
        )
    })
}

pub(crate) fn attr_pos(n: Node<'_, '_>, attr: &str) -> Pos {
    match n.attribute_node(attr) {
        Some(a) => pos_at(n.document(), a.range().start),
        None => node_pos(n),
    }
}

/// A text node's content as PML lays it out: the formatting whitespace at
/// either end removed (a run of whitespace that holds a line break: the
/// indentation and line breaks around elements), every other character
/// kept, so that `for <param/> days` keeps the spaces around its argument;
/// `None` when nothing is left. The position is that of the first kept
/// character.
pub(crate) fn text(n: Node<'_, '_>) -> Option<(String, Pos)> {
    let t = n.text()?;
    let kept = without_formatting(t);
    if kept.is_empty() {
        return None;
    }
    // The raw text may hold entity references, so the offset of the first
    // kept character is found in the raw input, not in the decoded text.
    let range = n.range();
    let raw = n.document().input_text().get(range.clone()).unwrap_or("");
    let lead = raw.len() - without_formatting_start(raw).len();
    Some((kept.to_string(), pos_at(n.document(), range.start + lead)))
}

/// Where a text node that holds more than whitespace starts (its first
/// non-whitespace character); `None` for whitespace only. For places that
/// take elements only (a union, an import), where any whitespace is
/// formatting.
pub(crate) fn non_space(n: Node<'_, '_>) -> Option<Pos> {
    let t = n.text()?;
    if t.trim_matches(is_xml_space).is_empty() {
        return None;
    }
    let range = n.range();
    let raw = n.document().input_text().get(range.clone()).unwrap_or("");
    let lead = raw.len() - raw.trim_start_matches(is_xml_space).len();
    Some(pos_at(n.document(), range.start + lead))
}

/// `t` without a leading whitespace run that holds a line break.
fn without_formatting_start(t: &str) -> &str {
    let rest = t.trim_start_matches(is_xml_space);
    if t[..t.len() - rest.len()].contains(['\n', '\r']) {
        rest
    } else {
        t
    }
}

/// `t` without leading and trailing whitespace runs that hold a line
/// break (formatting); other whitespace is text.
pub(crate) fn without_formatting(t: &str) -> &str {
    let t = without_formatting_start(t);
    let rest = t.trim_end_matches(is_xml_space);
    if t[rest.len()..].contains(['\n', '\r']) {
        rest
    } else {
        t
    }
}

pub(crate) fn is_xml_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

/// Fails unless `name` can be written as an element (module) or attribute
/// (param) name without a namespace and, for modules, is not a PML tag.
pub(crate) fn check_name(what: &'static str, name: &str, pos: Pos) -> Result<()> {
    let bad = |why| {
        Err(Error::new(
            pos,
            ErrorKind::BadName {
                what,
                name: name.to_string(),
                why,
            },
        ))
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return bad("empty"),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return bad("must start with an ASCII letter or '_'")
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) {
        return bad("only ASCII letters, digits, '_', '-' and '.' may follow");
    }
    if what == "module" && RESERVED.contains(&name) {
        return bad("it is a PML tag");
    }
    Ok(())
}
