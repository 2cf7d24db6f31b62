//! `<prompt schema="...">` documents (§3.2.1): module imports with their
//! arguments, nested imports, and the prompt's own text.

use std::collections::BTreeMap;

use roxmltree::Node;

use crate::error::{Error, ErrorKind, Pos, Result};
use crate::schema::{Item, ModuleId, Schema};
use crate::xml::{self, ROLES};

/// The most module names an "unknown module" error lists.
const LISTED: usize = 12;

/// A parsed prompt, checked against its schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    schema: String,
    items: Vec<PromptItem>,
}

/// One piece of a prompt's top level, in document order (role tags are
/// transparent: their content stands here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptItem {
    /// The prompt's own text (whitespace-trimmed, never empty).
    Text {
        /// The text.
        text: String,
        /// Where it starts.
        pos: Pos,
    },
    /// A module import.
    Import(Import),
}

/// `<name arg="value" ...>` with its nested imports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Import {
    /// The module imported.
    pub module: ModuleId,
    /// Arguments, in the order given.
    pub args: Vec<Argument>,
    /// Imports of modules nested in this one.
    pub children: Vec<Import>,
    /// Where the import element is.
    pub pos: Pos,
}

/// A value for a module's parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Argument {
    /// Index into the module's [`crate::Module::params`].
    pub param: usize,
    /// The value, whitespace-trimmed.
    pub value: String,
    /// Where the attribute is.
    pub pos: Pos,
}

impl Prompt {
    /// Parses a prompt and checks it against `schema`.
    ///
    /// # Errors
    /// Malformed XML, a root other than `<prompt>`, a `schema` attribute
    /// other than `schema`'s name, an unknown module, a module imported
    /// twice or outside its parent, two members of one union, an argument
    /// for a parameter the module lacks, text inside an import, a role tag
    /// inside another: each with its line and column. Argument lengths are
    /// checked by the layout, which knows the tokenizer.
    pub fn parse(text: &str, schema: &Schema) -> Result<Prompt> {
        Self::parse_with(text, |name| (name == schema.name()).then_some(schema)).map_err(
            |e| match e.kind {
                ErrorKind::UnknownSchema { named, .. } => Error::new(
                    e.pos,
                    ErrorKind::SchemaMismatch {
                        named,
                        given: schema.name().into(),
                    },
                ),
                _ => e,
            },
        )
    }

    /// Parses a prompt whose schema `lookup` finds by name.
    ///
    /// # Errors
    /// As [`Prompt::parse`]; [`ErrorKind::UnknownSchema`] when `lookup`
    /// returns `None`.
    pub fn parse_with<'s>(
        text: &str,
        lookup: impl FnOnce(&str) -> Option<&'s Schema>,
    ) -> Result<Prompt> {
        let doc = xml::parse(text)?;
        let root = doc.root_element();
        if xml::tag(root) != "prompt" {
            return Err(Error::new(
                xml::node_pos(root),
                ErrorKind::WrongRoot {
                    found: xml::tag(root),
                    expected: "prompt",
                },
            ));
        }
        xml::check_attrs(root, &["schema"])?;
        let named = xml::required(root, "schema")?;
        let Some(schema) = lookup(named) else {
            return Err(Error::new(
                xml::attr_pos(root, "schema"),
                ErrorKind::UnknownSchema {
                    named: named.into(),
                    known: String::new(),
                },
            ));
        };
        let mut p = Parser {
            schema,
            imported: BTreeMap::new(),
            unions: BTreeMap::new(),
        };
        let mut items = Vec::new();
        p.top(root, None, &mut items)?;
        Ok(Prompt {
            schema: named.into(),
            items,
        })
    }

    /// The name of the schema the prompt uses.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The top level, in document order.
    pub fn items(&self) -> &[PromptItem] {
        &self.items
    }

    /// Every module imported, nested ones included.
    pub fn imported(&self) -> Vec<ModuleId> {
        fn walk(i: &Import, out: &mut Vec<ModuleId>) {
            out.push(i.module);
            for c in &i.children {
                walk(c, out);
            }
        }
        let mut out = Vec::new();
        for it in &self.items {
            if let PromptItem::Import(i) = it {
                walk(i, &mut out);
            }
        }
        out
    }
}

struct Parser<'s> {
    schema: &'s Schema,
    /// Module -> where it was imported.
    imported: BTreeMap<ModuleId, Pos>,
    /// Union -> the member imported.
    unions: BTreeMap<usize, ModuleId>,
}

impl Parser<'_> {
    fn top(
        &mut self,
        node: Node<'_, '_>,
        role: Option<&str>,
        out: &mut Vec<PromptItem>,
    ) -> Result<()> {
        for c in node.children() {
            if c.is_text() {
                if let Some((text, pos)) = xml::text(c) {
                    out.push(PromptItem::Text { text, pos });
                }
                continue;
            }
            if !c.is_element() {
                continue;
            }
            let t = xml::tag(c);
            if ROLES.contains(&t.as_str()) {
                xml::check_attrs(c, &[])?;
                if let Some(outer) = role {
                    return Err(Error::new(
                        xml::node_pos(c),
                        ErrorKind::RoleInRole {
                            inner: t,
                            outer: outer.into(),
                        },
                    ));
                }
                self.top(c, Some(&t), out)?;
                continue;
            }
            let i = self.import(c, None)?;
            out.push(PromptItem::Import(i));
        }
        Ok(())
    }

    fn import(&mut self, node: Node<'_, '_>, parent: Option<ModuleId>) -> Result<Import> {
        let s = self.schema;
        let name = xml::tag(node);
        let pos = xml::node_pos(node);
        let Some(id) = s.find(&name) else {
            let names: Vec<&str> = s
                .children(parent)
                .iter()
                .map(|&m| s.module(m).name.as_str())
                .collect();
            let mut expected = names
                .iter()
                .take(LISTED)
                .map(|n| format!("<{n}>"))
                .collect::<Vec<_>>()
                .join(", ");
            if names.len() > LISTED {
                expected.push_str(&format!(" (and {} more)", names.len() - LISTED));
            }
            if parent.is_none() {
                let roles = "<system>, <user>, <assistant> or text";
                expected = if expected.is_empty() {
                    roles.into()
                } else {
                    format!("{expected}, {roles}")
                };
            } else if expected.is_empty() {
                expected = "nothing (it has no nested modules)".into();
            }
            return Err(Error::new(
                pos,
                ErrorKind::UnknownModule {
                    name,
                    schema: s.name().into(),
                    expected,
                },
            ));
        };
        let m = s.module(id);
        if m.parent != parent {
            let place = |p: Option<ModuleId>| match p {
                Some(p) => format!("directly inside <{}>", s.module(p).name),
                None => "at the top level of the prompt".to_string(),
            };
            return Err(Error::new(
                pos,
                ErrorKind::WrongParent {
                    name,
                    found: place(parent),
                    expected: place(m.parent),
                },
            ));
        }
        if let Some(&first) = self.imported.get(&id) {
            return Err(Error::new(pos, ErrorKind::DuplicateImport { name, first }));
        }
        self.imported.insert(id, pos);
        if let Some(u) = m.union {
            if let Some(&other) = self.unions.get(&u) {
                return Err(Error::new(
                    pos,
                    ErrorKind::UnionConflict {
                        first: s.module(other).name.clone(),
                        second: name,
                    },
                ));
            }
            self.unions.insert(u, id);
        }
        let mut args = Vec::new();
        for a in node.attributes() {
            let apos = xml::pos_at(node.document(), a.range().start);
            let found = if a.namespace().is_none() {
                m.params.iter().position(|p| p.name == a.name())
            } else {
                None
            };
            let Some(param) = found else {
                let expected = if m.params.is_empty() {
                    "none (it has no parameters)".to_string()
                } else {
                    m.params
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(Error::new(
                    apos,
                    ErrorKind::UnknownParam {
                        module: name,
                        param: a.name().into(),
                        expected,
                    },
                ));
            };
            args.push(Argument {
                param,
                value: a.value().trim_matches(xml::is_xml_space).into(),
                pos: apos,
            });
        }
        let mut children = Vec::new();
        for c in node.children() {
            if c.is_text() {
                if let Some(tpos) = xml::non_space(c) {
                    return Err(Error::new(tpos, ErrorKind::TextInImport { module: name }));
                }
            } else if c.is_element() {
                children.push(self.import(c, Some(id))?);
            }
        }
        Ok(Import {
            module: id,
            args,
            children,
            pos,
        })
    }
}

/// The top-level item of `schema` that holds module `m` (itself or the
/// union it is a member of).
pub(crate) fn top_index(schema: &Schema, m: ModuleId) -> Option<usize> {
    schema.body().iter().position(|it| match it {
        Item::Module(x) => *x == m,
        Item::Union { members, .. } => members.contains(&m),
        _ => false,
    })
}
