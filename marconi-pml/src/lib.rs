//! # marconi-pml
//!
//! Prompt Cache's Prompt Markup Language (Gim et al., MLSys 2024, §3): an
//! application declares the reusable segments of its prompts as modules of
//! a *schema*; each module's attention states are computed once at the
//! positions the schema fixes, and reused wherever a *prompt* derived from
//! the schema imports the module, not only as a prefix.
//!
//! * [`Schema`]: `<schema name>` with `<module name>`, `<union>`,
//!   `<param name len>`, nested modules, `<system>`/`<user>`/`<assistant>`
//!   and anonymous text.
//! * [`Prompt`]: `<prompt schema>` importing modules (`<trip-plan
//!   duration="3 days"/>`), nested imports, its own text.
//! * [`Encoded`] and [`Layout`]: position ids (§3.3, §3.4): which segments
//!   of a prompt are cached module content and which the engine computes.
//! * [`ReusePlan`]: what a lookup reuses, and how, under a named
//!   [`ReuseMode`]: every module for attention-only models; for hybrid
//!   models the exact leading run of modules, and optionally the modules
//!   after it by approximate state composition.
//! * [`ModuleCache`]: the module store: a registered schema's module
//!   entries pinned in a byte budget, evicted by utility once unregistered,
//!   and a lookup that says per segment which entry serves it and how.
//!
//! Only formatting whitespace is dropped: a run of whitespace that holds a
//! line break at either end of a text (the indentation and line breaks
//! around elements); `for <param/> days` keeps both spaces. A character
//! reference or character that is not an XML 1.0 `Char` (`&#xD800;`,
//! `&#x110000;`, `&#1;`) is an error, as XML makes it.
//!
//! Every error carries the line and column it was found at ([`Error`]).
//! Pure: no I/O, no unsafe; the engine's tokenizer comes in as a
//! [`Tokenizer`].
//!
//! ```
//! use marconi_pml::{ByteTokenizer, Encoded, Prompt, Schema};
//!
//! let schema = Schema::parse(r#"<schema name="s">
//!     <module name="intro">Hello</module>
//!     <module name="plan">Plan <param name="days" len="3"/> days</module>
//! </schema>"#).unwrap();
//! let enc = Encoded::new(schema, &mut ByteTokenizer).unwrap();
//! let prompt = Prompt::parse(r#"<prompt schema="s"><plan days="two"/>Go</prompt>"#, enc.schema()).unwrap();
//! let layout = enc.layout(&prompt, &mut ByteTokenizer).unwrap();
//! let spans: Vec<(u32, u32, bool)> = layout.segments.iter().map(|s| (s.start, s.len, s.cached)).collect();
//! // "Plan " at 5..10 (the space before the parameter is text), "two" at
//! // 10..13 (3 reserved), " days" at 13..18, "Go" after it.
//! assert_eq!(spans, [(5, 5, true), (10, 3, false), (13, 5, true), (18, 2, false)]);
//! ```

#![forbid(unsafe_code)]

mod error;
mod layout;
mod prompt;
mod reuse;
mod schema;
mod store;
mod xml;

pub use error::{Error, ErrorKind, Pos, Result};
pub use layout::{ByteTokenizer, Encoded, Layout, Segment, SegmentKind, Tokenizer};
pub use prompt::{Argument, Import, Prompt, PromptItem};
pub use reuse::{namespace, Reuse, ReuseMode, ReusePlan};
pub use schema::{Item, Module, ModuleId, Param, Schema, MAX_DEPTH};
pub use store::{
    EntryId, ModuleCache, ModuleCacheStats, ModuleLookup, ModuleModel, ModuleRef, SchemaId,
    SegmentLookup, Served, StoreError,
};
