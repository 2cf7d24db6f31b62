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
    let opt = ParsingOptions {
        allow_dtd: false,
        nodes_limit: NODES_LIMIT,
        ..ParsingOptions::default()
    };
    Document::parse_with_options(text, opt).map_err(|e| Error::xml(&e))
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

/// A text node's content as PML lays it out: leading and trailing
/// whitespace removed, inner whitespace kept; `None` when nothing is left.
/// The position is that of the first kept character.
pub(crate) fn text(n: Node<'_, '_>) -> Option<(String, Pos)> {
    let t = n.text()?;
    let trimmed = t.trim_matches(is_xml_space);
    if trimmed.is_empty() {
        return None;
    }
    // The raw text may hold entity references, so the offset of the first
    // kept character is found in the raw input, not in the decoded text.
    let range = n.range();
    let raw = n.document().input_text().get(range.clone()).unwrap_or("");
    let lead = raw.len() - raw.trim_start_matches(is_xml_space).len();
    Some((
        trimmed.to_string(),
        pos_at(n.document(), range.start + lead),
    ))
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
