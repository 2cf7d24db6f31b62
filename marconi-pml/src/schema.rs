//! `<schema>` documents (§3.2.1): modules, unions, parameters, nested
//! modules and anonymous text.

use std::collections::BTreeMap;

use roxmltree::Node;

use crate::error::{Error, ErrorKind, Pos, Result};
use crate::xml::{self, ROLES};

/// The deepest module nesting a schema may have. Parsing, encoding and
/// layout recurse once per level; the bound keeps them far from the stack's
/// end on any thread (a stack overflow would abort the host process).
pub const MAX_DEPTH: u32 = 32;

/// A module's index in [`Schema::modules`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModuleId(pub usize);

/// One piece of a schema's or a module's body, in document order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    /// Text (whitespace-trimmed, never empty): module content inside a
    /// module, an anonymous module at the schema's top level.
    Text {
        /// The text.
        text: String,
        /// Where it starts.
        pos: Pos,
    },
    /// A module, possibly nested in the module whose body holds this item.
    Module(ModuleId),
    /// Modules that start at one position; a prompt imports at most one.
    Union {
        /// The members, in document order.
        members: Vec<ModuleId>,
        /// Where `<union>` is.
        pos: Pos,
    },
    /// A parameter: index into its module's [`Module::params`].
    Param(usize),
}

/// A `<param name len>`: `len` positions an argument takes in a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Its name (the attribute a prompt supplies the argument with).
    pub name: String,
    /// The most tokens an argument may have; the positions it reserves.
    pub len: u32,
    /// Where `<param>` is.
    pub pos: Pos,
}

/// A `<module name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    /// Its name, unique in the schema.
    pub name: String,
    /// The module whose body holds it (directly or in a union), if nested.
    pub parent: Option<ModuleId>,
    /// The union it is a member of: index of the union in document order.
    pub union: Option<usize>,
    /// Its content.
    pub body: Vec<Item>,
    /// Its parameters, in document order.
    pub params: Vec<Param>,
    /// Where `<module>` is.
    pub pos: Pos,
    /// Its nesting level: 1 at the top level, at most [`MAX_DEPTH`].
    pub depth: u32,
}

/// A parsed schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    name: String,
    body: Vec<Item>,
    modules: Vec<Module>,
    by_name: BTreeMap<String, ModuleId>,
}

impl Schema {
    /// Parses a `<schema name="...">` document.
    ///
    /// # Errors
    /// Malformed XML, an unknown element or attribute, a missing or invalid
    /// name, a module or parameter defined twice, a `len` that is not a
    /// positive integer, a parameter outside a module, text in or an empty
    /// `<union>`, a role tag inside another: each with its line and column.
    pub fn parse(text: &str) -> Result<Schema> {
        let doc = xml::parse(text)?;
        let root = doc.root_element();
        if xml::tag(root) != "schema" {
            return Err(Error::new(
                xml::node_pos(root),
                ErrorKind::WrongRoot {
                    found: xml::tag(root),
                    expected: "schema",
                },
            ));
        }
        xml::check_attrs(root, &["name"])?;
        let name = xml::required(root, "name")?.to_string();
        let mut p = Parser {
            modules: Vec::new(),
            by_name: BTreeMap::new(),
            unions: 0,
        };
        let mut body = Vec::new();
        p.body(root, None, None, &mut body)?;
        Ok(Schema {
            name,
            body,
            modules: p.modules,
            by_name: p.by_name,
        })
    }

    /// The schema's name (a prompt's `schema` attribute).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The top level: anonymous text, modules and unions.
    pub fn body(&self) -> &[Item] {
        &self.body
    }

    /// Every module, nested ones included, in document order.
    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// One module.
    ///
    /// # Panics
    /// When `id` is not from this schema.
    pub fn module(&self, id: ModuleId) -> &Module {
        &self.modules[id.0]
    }

    /// The module with this name.
    pub fn find(&self, name: &str) -> Option<ModuleId> {
        self.by_name.get(name).copied()
    }

    /// The modules a prompt may import directly inside `parent` (at the top
    /// level when `None`), in document order.
    pub fn children(&self, parent: Option<ModuleId>) -> Vec<ModuleId> {
        (0..self.modules.len())
            .map(ModuleId)
            .filter(|&m| self.modules[m.0].parent == parent)
            .collect()
    }
}

struct Parser {
    modules: Vec<Module>,
    by_name: BTreeMap<String, ModuleId>,
    unions: usize,
}

impl Parser {
    /// Reads the children of `node` (the schema, a module or a role tag)
    /// into `out`. `module` is the innermost module around, `role` the role
    /// tag around.
    fn body(
        &mut self,
        node: Node<'_, '_>,
        module: Option<ModuleId>,
        role: Option<&str>,
        out: &mut Vec<Item>,
    ) -> Result<()> {
        for c in node.children() {
            if c.is_text() {
                if let Some((text, pos)) = xml::text(c) {
                    out.push(Item::Text { text, pos });
                }
                continue;
            }
            if !c.is_element() {
                continue; // comments, processing instructions
            }
            let t = xml::tag(c);
            match t.as_str() {
                "module" => {
                    let id = self.module(c, module, None)?;
                    out.push(Item::Module(id));
                }
                "union" => {
                    xml::check_attrs(c, &[])?;
                    let u = self.unions;
                    self.unions += 1;
                    let mut members = Vec::new();
                    for m in c.children() {
                        if m.is_text() {
                            if let Some(pos) = xml::non_space(m) {
                                return Err(Error::new(pos, ErrorKind::TextInUnion));
                            }
                        } else if m.is_element() {
                            if xml::tag(m) != "module" {
                                return Err(Error::new(
                                    xml::node_pos(m),
                                    ErrorKind::UnknownElement {
                                        found: xml::tag(m),
                                        context: "<union>".into(),
                                        expected: "<module>".into(),
                                    },
                                ));
                            }
                            members.push(self.module(m, module, Some(u))?);
                        }
                    }
                    if members.is_empty() {
                        return Err(Error::new(xml::node_pos(c), ErrorKind::EmptyUnion));
                    }
                    out.push(Item::Union {
                        members,
                        pos: xml::node_pos(c),
                    });
                }
                "param" => {
                    xml::check_attrs(c, &["name", "len"])?;
                    let name = xml::required(c, "name")?;
                    let pos = xml::node_pos(c);
                    let Some(m) = module else {
                        return Err(Error::new(
                            pos,
                            ErrorKind::ParamOutsideModule { name: name.into() },
                        ));
                    };
                    xml::check_name("param", name, xml::attr_pos(c, "name"))?;
                    let raw = xml::required(c, "len")?;
                    let len = match raw.trim_matches(xml::is_xml_space).parse::<u32>() {
                        Ok(n) if n > 0 => n,
                        _ => {
                            return Err(Error::new(
                                xml::attr_pos(c, "len"),
                                ErrorKind::BadLen {
                                    param: name.into(),
                                    value: raw.into(),
                                },
                            ))
                        }
                    };
                    if c.has_children() {
                        return Err(Error::new(
                            pos,
                            ErrorKind::NotEmpty {
                                element: "param".into(),
                            },
                        ));
                    }
                    let module = &mut self.modules[m.0];
                    if let Some(first) = module.params.iter().find(|q| q.name == name) {
                        return Err(Error::new(
                            xml::attr_pos(c, "name"),
                            ErrorKind::DuplicateParam {
                                name: name.into(),
                                module: module.name.clone(),
                                first: first.pos,
                            },
                        ));
                    }
                    let params = &mut module.params;
                    params.push(Param {
                        name: name.into(),
                        len,
                        pos,
                    });
                    out.push(Item::Param(params.len() - 1));
                }
                r if ROLES.contains(&r) => {
                    xml::check_attrs(c, &[])?;
                    if let Some(outer) = role {
                        return Err(Error::new(
                            xml::node_pos(c),
                            ErrorKind::RoleInRole {
                                inner: r.into(),
                                outer: outer.into(),
                            },
                        ));
                    }
                    self.body(c, module, Some(r), out)?;
                }
                _ => {
                    let context = match module {
                        Some(m) => format!("module '{}'", self.modules[m.0].name),
                        None => "<schema>".into(),
                    };
                    let mut expected = "<module>, <union>, <system>, <user>, <assistant> or text";
                    if module.is_some() {
                        expected =
                            "<module>, <union>, <param>, <system>, <user>, <assistant> or text";
                    }
                    return Err(Error::new(
                        xml::node_pos(c),
                        ErrorKind::UnknownElement {
                            found: t,
                            context,
                            expected: expected.into(),
                        },
                    ));
                }
            }
        }
        Ok(())
    }

    fn module(
        &mut self,
        node: Node<'_, '_>,
        parent: Option<ModuleId>,
        union: Option<usize>,
    ) -> Result<ModuleId> {
        xml::check_attrs(node, &["name"])?;
        let name = xml::required(node, "name")?;
        xml::check_name("module", name, xml::attr_pos(node, "name"))?;
        let pos = xml::node_pos(node);
        let depth = parent.map_or(1, |p| self.modules[p.0].depth + 1);
        if depth > MAX_DEPTH {
            return Err(Error::new(pos, ErrorKind::TooDeep { max: MAX_DEPTH }));
        }
        if let Some(&first) = self.by_name.get(name) {
            return Err(Error::new(
                xml::attr_pos(node, "name"),
                ErrorKind::DuplicateModule {
                    name: name.into(),
                    first: self.modules[first.0].pos,
                },
            ));
        }
        let id = ModuleId(self.modules.len());
        self.modules.push(Module {
            name: name.into(),
            parent,
            union,
            body: Vec::new(),
            params: Vec::new(),
            pos,
            depth,
        });
        self.by_name.insert(name.into(), id);
        let mut body = Vec::new();
        // A role tag around a module does not extend into it: the module's
        // body may hold its own role tags.
        self.body(node, Some(id), None, &mut body)?;
        self.modules[id.0].body = body;
        Ok(id)
    }
}
