//! Errors with the line and column they were found at.

use std::fmt;

/// A place in a PML document: 1-based line and column (columns count
/// characters, as roxmltree does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pos {
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub col: u32,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// Everything that makes a schema or a prompt unusable, each with what was
/// expected instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Not well-formed XML (roxmltree's reason).
    #[error("malformed XML: {0}")]
    Xml(String),
    /// The document's root element is not the one expected.
    #[error("root element is <{found}>; expected <{expected}>")]
    WrongRoot {
        /// The root found.
        found: String,
        /// `schema` or `prompt`.
        expected: &'static str,
    },
    /// An element that has no meaning where it stands.
    #[error("unknown element <{found}> in {context}; expected {expected}")]
    UnknownElement {
        /// The element's name.
        found: String,
        /// Where it stands (`<schema>`, `module 'x'`, ...).
        context: String,
        /// What may stand there.
        expected: String,
    },
    /// An attribute the element does not take.
    #[error("unknown attribute '{attr}' on <{element}>; expected {expected}")]
    UnknownAttribute {
        /// The element.
        element: String,
        /// The attribute.
        attr: String,
        /// The attributes it takes.
        expected: String,
    },
    /// A required attribute is absent.
    #[error("<{element}> needs the attribute '{attr}'")]
    MissingAttribute {
        /// The element.
        element: String,
        /// The attribute.
        attr: &'static str,
    },
    /// A name that cannot be imported as an element, or clashes with a PML tag.
    #[error("invalid {what} name '{name}': {why}")]
    BadName {
        /// `module` or `param`.
        what: &'static str,
        /// The name.
        name: String,
        /// Why it cannot be used.
        why: &'static str,
    },
    /// `len` is not a positive integer.
    #[error("len=\"{value}\" of param '{param}' is not a positive integer")]
    BadLen {
        /// The parameter.
        param: String,
        /// The value given.
        value: String,
    },
    /// Two modules with one name (module names are unique in a schema).
    #[error("module '{name}' is defined twice (first at {first})")]
    DuplicateModule {
        /// The name.
        name: String,
        /// Where the first definition is.
        first: Pos,
    },
    /// Two parameters with one name in one module.
    #[error("param '{name}' is defined twice in module '{module}' (first at {first})")]
    DuplicateParam {
        /// The parameter.
        name: String,
        /// Its module.
        module: String,
        /// Where the first definition is.
        first: Pos,
    },
    /// A `<param>` outside every module.
    #[error(
        "<param name=\"{name}\"> outside a module; a parameter belongs to the <module> around it"
    )]
    ParamOutsideModule {
        /// The parameter.
        name: String,
    },
    /// Text inside a `<union>`, whose children are modules only.
    #[error("text inside <union>; expected only <module> elements there")]
    TextInUnion,
    /// A `<union>` without modules.
    #[error("<union> has no <module>; expected at least one")]
    EmptyUnion,
    /// An element that must be empty has content.
    #[error("<{element}> must be empty")]
    NotEmpty {
        /// The element.
        element: String,
    },
    /// A role tag inside another role tag.
    #[error("<{inner}> inside <{outer}>; role tags do not nest")]
    RoleInRole {
        /// The inner role.
        inner: String,
        /// The outer role.
        outer: String,
    },
    /// The prompt names another schema than the one it is laid out against.
    #[error("prompt uses schema '{named}' but the schema given is '{given}'")]
    SchemaMismatch {
        /// The `schema` attribute of `<prompt>`.
        named: String,
        /// The schema's name.
        given: String,
    },
    /// The prompt names a schema that is not registered.
    #[error("prompt uses schema '{named}', which is not registered{known}")]
    UnknownSchema {
        /// The `schema` attribute of `<prompt>`.
        named: String,
        /// `" (registered: a, b)"` or empty.
        known: String,
    },
    /// The prompt imports a module the schema does not define.
    #[error("unknown module '{name}' in schema '{schema}'; expected one of: {expected}")]
    UnknownModule {
        /// The element's name.
        name: String,
        /// The schema.
        schema: String,
        /// The modules importable there.
        expected: String,
    },
    /// A module imported elsewhere than directly inside its parent's import.
    #[error("module '{name}' is imported {found}; import it {expected}")]
    WrongParent {
        /// The module.
        name: String,
        /// Where it was imported (`at the top level`, `inside <x>`).
        found: String,
        /// Where it belongs.
        expected: String,
    },
    /// One module imported twice.
    #[error("module '{name}' is imported twice (first at {first})")]
    DuplicateImport {
        /// The module.
        name: String,
        /// The first import.
        first: Pos,
    },
    /// Two members of one union imported.
    #[error("modules '{first}' and '{second}' are members of one <union>; import at most one")]
    UnionConflict {
        /// The member imported first.
        first: String,
        /// The member imported second.
        second: String,
    },
    /// An argument for a parameter the module does not have.
    #[error("module '{module}' has no param '{param}'; expected {expected}")]
    UnknownParam {
        /// The module.
        module: String,
        /// The attribute given.
        param: String,
        /// Its parameters.
        expected: String,
    },
    /// An argument longer than its parameter's `len`.
    #[error(
        "argument for param '{param}' of module '{module}' is {tokens} tokens; its len is {len}"
    )]
    ArgumentTooLong {
        /// The module.
        module: String,
        /// The parameter.
        param: String,
        /// The argument's length in tokens.
        tokens: usize,
        /// The parameter's `len`.
        len: u32,
    },
    /// Text inside a module import (text goes before or after imports).
    #[error(
        "text inside the import of module '{module}'; put prompt text before or after <{module}>"
    )]
    TextInImport {
        /// The module.
        module: String,
    },
    /// Modules nested deeper than the parser follows.
    #[error("modules nested deeper than {max}; expected at most {max} levels")]
    TooDeep {
        /// The deepest nesting accepted.
        max: u32,
    },
    /// More position ids than a u32 holds.
    #[error("the layout needs more than {max} position ids")]
    PositionOverflow {
        /// The largest position id.
        max: u32,
    },
}

/// A PML error: what went wrong, and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{pos}: {kind}")]
pub struct Error {
    /// Where in the document (schema or prompt) the error is.
    pub pos: Pos,
    /// What went wrong.
    pub kind: ErrorKind,
}

impl Error {
    pub(crate) fn new(pos: Pos, kind: ErrorKind) -> Self {
        Error { pos, kind }
    }

    /// roxmltree's own error, its position made ours and taken out of the
    /// text (it would otherwise be printed twice).
    pub(crate) fn xml(e: &roxmltree::Error) -> Self {
        let p = e.pos();
        let mut msg = e.to_string();
        let suffix = format!(" at {}:{}", p.row, p.col);
        if let Some(stripped) = msg.strip_suffix(&suffix) {
            msg = stripped.to_string();
        }
        Error::new(
            Pos {
                line: p.row,
                col: p.col,
            },
            ErrorKind::Xml(msg),
        )
    }
}

/// A result with a PML [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
