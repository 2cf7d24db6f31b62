//! Prompt Markup Language from C (marconi-pml): register a schema, lay a
//! prompt out over it. The engine's tokenizer comes in as a callback (NULL:
//! one token per UTF-8 byte). A PML error is MARCONI_STATUS_INVALID_ARGUMENT
//! with its line, column and text in the caller's `marconi_pml_error`.

use std::ffi::{c_char, c_void};

use marconi_pml::{ByteTokenizer, Encoded, Prompt, Schema, SegmentKind, Tokenizer};

use crate::handle::{borrow, handle_kind, publish, release};
use crate::status::{
    boundary, boundary_or, check_ptr, in_slice, marconi_status, out_slice, require, write_c_string,
    FfiError, FfiResult,
};

/// The most tokens one text may have (a tokenizer answering more is refused).
const MAX_TEXT_TOKENS: i64 = 1 << 30;

/// A registered schema: parsed, tokenized and laid out once. Immutable: any
/// number of threads may lay prompts out over it at once.
pub struct marconi_pml_schema {
    enc: Encoded,
    ns: u64,
}
handle_kind!(marconi_pml_schema, PmlSchema, "marconi_pml_schema");

/// Checks the schema pointer and borrows the handle.
///
/// # Safety
///
/// `schema` is NULL or a live handle from marconi_pml_schema_new.
pub(crate) unsafe fn schema_ref<'a>(
    schema: *const marconi_pml_schema,
) -> FfiResult<&'a marconi_pml_schema> {
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(schema, "schema") }
}

impl marconi_pml_schema {
    /// The encoded schema.
    pub(crate) fn encoded(&self) -> &Encoded {
        &self.enc
    }
}

/// The engine's tokenizer: writes the token ids of `text[0..text_len]`
/// (UTF-8, not NUL-terminated) into `out[0..cap]` and returns their count.
/// When the count is larger than `cap` it returns the count without
/// writing (or writing at most `cap`) and is called again with a buffer of
/// that size. A negative return is a tokenizer failure (the call fails with
/// MARCONI_STATUS_INVALID_ARGUMENT). It must return the same tokens for the
/// same text within one call. `user` is passed through unchanged.
pub type marconi_pml_tokenize_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        text: *const u8,
        text_len: usize,
        out: *mut u32,
        cap: usize,
    ) -> i64,
>;

/// The size of `marconi_pml_error::message`.
pub const MARCONI_PML_ERROR_MESSAGE_BYTES: usize = 256;

/// Where and why a schema or prompt was refused: 1-based line and column in
/// the document (0 when the error has no place, such as a tokenizer
/// failure) and the reason, NUL-terminated, truncated to fit.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_pml_error {
    /// 1-based line; 0 when the error has no place in the document.
    pub line: u32,
    /// 1-based column (characters); 0 when the error has no place.
    pub col: u32,
    /// The reason ("unknown module 'b' in schema 's'; expected ...").
    pub message: [c_char; MARCONI_PML_ERROR_MESSAGE_BYTES],
}

/// What a segment of a layout is.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pml_segment_kind {
    /// Text of a named module: cached.
    Module = 0,
    /// The schema's text outside every module (an anonymous module every
    /// prompt includes): cached.
    Anonymous = 1,
    /// A parameter's argument, at the positions the parameter reserves:
    /// computed.
    Param = 2,
    /// The prompt's own text: computed.
    Text = 3,
}

/// One run of tokens at consecutive position ids.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_pml_segment {
    /// What it is.
    pub kind: marconi_pml_segment_kind,
    /// Whether its states come from the module cache (module and anonymous
    /// text) or must be computed (arguments, prompt text).
    pub cached: bool,
    /// First position id.
    pub start: u32,
    /// Token count: positions start .. start + len.
    pub len: u32,
    /// Index of its module in the schema (marconi_pml_name), -1 for
    /// anonymous and prompt text.
    pub module: i32,
    /// Index of the parameter in its module for kind PARAM, else -1.
    pub param: i32,
    /// Where its token ids start in the `tokens` output of
    /// marconi_pml_layout.
    pub tokens_offset: usize,
}

struct Callback {
    f: unsafe extern "C" fn(*mut c_void, *const u8, usize, *mut u32, usize) -> i64,
    user: *mut c_void,
    failed: Option<String>,
}

impl Tokenizer for Callback {
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        if self.failed.is_some() {
            return Vec::new();
        }
        let mut buf: Vec<u32> = vec![0; text.len().max(16)];
        for _ in 0..2 {
            // SAFETY: text is valid for text.len() bytes and buf for
            // buf.len() writable u32s; the callback's contract bounds its
            // writes by cap.
            let n = unsafe {
                (self.f)(
                    self.user,
                    text.as_ptr(),
                    text.len(),
                    buf.as_mut_ptr(),
                    buf.len(),
                )
            };
            if !(0..=MAX_TEXT_TOKENS).contains(&n) {
                self.failed = Some(format!("tokenizer returned {n}"));
                return Vec::new();
            }
            let n = n as usize;
            if n <= buf.len() {
                buf.truncate(n);
                return buf;
            }
            buf = vec![0; n];
        }
        self.failed = Some("tokenizer asked for a larger buffer twice".into());
        Vec::new()
    }
}

/// Runs `body` with the caller's tokenizer (bytes when NULL); a tokenizer
/// failure fails the call.
fn with_tokenizer<T>(
    f: marconi_pml_tokenize_fn,
    user: *mut c_void,
    body: impl FnOnce(&mut dyn Tokenizer) -> Result<T, marconi_pml::Error>,
) -> FfiResult<Result<T, marconi_pml::Error>> {
    match f {
        None => Ok(body(&mut ByteTokenizer)),
        Some(f) => {
            let mut cb = Callback {
                f,
                user,
                failed: None,
            };
            let r = body(&mut cb);
            match cb.failed {
                Some(why) => Err(FfiError::new(marconi_status::InvalidArgument, why)),
                None => Ok(r),
            }
        }
    }
}

/// Writes `e` into `*err` (when not NULL) and turns it into the call's error.
fn pml_error(e: &marconi_pml::Error, err: *mut marconi_pml_error, what: &str) -> FfiError {
    write_error(err, e.pos.line, e.pos.col, &e.kind.to_string());
    FfiError::new(marconi_status::InvalidArgument, format!("{what}:{e}"))
}

fn write_error(err: *mut marconi_pml_error, line: u32, col: u32, text: &str) {
    if err.is_null() || !err.is_aligned() {
        return;
    }
    let mut out = marconi_pml_error {
        line,
        col,
        message: [0; MARCONI_PML_ERROR_MESSAGE_BYTES],
    };
    // Truncate on a character boundary so the text stays UTF-8.
    let mut n = text.len().min(MARCONI_PML_ERROR_MESSAGE_BYTES - 1);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    for (d, s) in out.message.iter_mut().zip(&text.as_bytes()[..n]) {
        *d = *s as c_char;
    }
    // SAFETY: err is non-NULL and aligned (checked) and writable by contract.
    unsafe { err.write(out) };
}

/// The document as UTF-8, or an error of its first bad byte.
fn document<'a>(bytes: &'a [u8], err: *mut marconi_pml_error, what: &str) -> FfiResult<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let good = std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or("");
        let line = good.matches('\n').count() + 1;
        let col = good.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        let (line, col) = (
            u32::try_from(line).unwrap_or(u32::MAX),
            u32::try_from(col).unwrap_or(u32::MAX),
        );
        write_error(err, line, col, "not UTF-8");
        FfiError::new(
            marconi_status::InvalidArgument,
            format!("{what}:{line}:{col}: not UTF-8"),
        )
    })
}

/// Parses the schema `xml[0..xml_len]` (UTF-8), tokenizes its text with
/// `tokenize` (NULL: one token per byte) and fixes every module's position
/// ids; writes the handle to `*out` (caller frees with
/// marconi_pml_schema_free).
///
/// MARCONI_STATUS_INVALID_ARGUMENT: the schema is not UTF-8 or not valid
/// PML (`*err`, when not NULL, gets the line, column and reason; the
/// documented exception to "outputs only on success"), or the tokenizer
/// failed. MARCONI_STATUS_EMPTY_TOKENS: `xml_len` is 0.
///
/// Thread safety: touches only its arguments; `tokenize` is called on the
/// calling thread before the function returns.
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `tokenize` is NULL or
/// follows its contract with `user`.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_schema_new(
    xml: *const u8,
    xml_len: usize,
    tokenize: marconi_pml_tokenize_fn,
    user: *mut c_void,
    out: *mut *mut marconi_pml_schema,
    err: *mut marconi_pml_error,
) -> marconi_status {
    boundary("marconi_pml_schema_new", || {
        require!(xml, len = xml_len);
        require!(out);
        check_ptr!(out);
        if xml_len == 0 {
            return Err(FfiError::new(marconi_status::EmptyTokens, "xml_len is 0"));
        }
        // SAFETY: checked non-NULL; xml_len readable bytes by contract.
        let bytes = unsafe { in_slice(xml, xml_len, "xml") }?;
        let text = document(bytes, err, "schema")?;
        let schema = Schema::parse(text).map_err(|e| pml_error(&e, err, "schema"))?;
        let enc = with_tokenizer(tokenize, user, |t| Encoded::new(schema, t))?
            .map_err(|e| pml_error(&e, err, "schema"))?;
        let ns = marconi_pml::namespace(&enc);
        let handle = marconi_pml_schema { enc, ns };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(handle, out) };
        Ok(())
    })
}

/// Frees a schema. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_schema_free(schema: *mut marconi_pml_schema) {
    boundary_or("marconi_pml_schema_free", (), || {
        // SAFETY: no other call runs on it (contract); anything but a live
        // handle of its kind is left alone.
        unsafe { release(schema) };
    })
}

/// Writes the schema's module count, the positions it spans (`0 ..
/// *total_positions`) and its cache namespace (a hash of the schema's name,
/// modules and tokens: the `ns` for marconi_cache_lookup of its exact
/// leading modules).
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_schema_info(
    schema: *const marconi_pml_schema,
    n_modules: *mut usize,
    total_positions: *mut u32,
    namespace: *mut u64,
) -> marconi_status {
    boundary("marconi_pml_schema_info", || {
        require!(schema);
        require!(n_modules);
        require!(total_positions);
        require!(namespace);
        check_ptr!(schema);
        check_ptr!(n_modules);
        check_ptr!(total_positions);
        check_ptr!(namespace);
        // SAFETY: a live handle (caller contract), checked non-NULL.
        let s = unsafe { schema_ref(schema) }?;
        // SAFETY: outputs checked non-NULL and aligned, writable by contract.
        unsafe {
            n_modules.write(s.enc.schema().modules().len());
            total_positions.write(s.enc.total());
            namespace.write(s.ns);
        }
        Ok(())
    })
}

/// Writes the name of module `module` (param < 0) or of parameter `param`
/// of that module into `buf[0..cap]`, NUL-terminated, truncated like
/// marconi_status_message; returns the full length without the NUL, 0 for
/// a NULL schema or an index out of range.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_name(
    schema: *const marconi_pml_schema,
    module: i32,
    param: i32,
    buf: *mut c_char,
    cap: usize,
) -> usize {
    boundary_or("marconi_pml_name", 0, || {
        // SAFETY: NULL or a live handle (caller contract); refused (0)
        // when NULL, misaligned or not a schema.
        let Ok(s) = (unsafe { schema_ref(schema) }) else {
            return 0;
        };
        let Some(m) = usize::try_from(module)
            .ok()
            .and_then(|m| s.enc.schema().modules().get(m))
        else {
            return 0;
        };
        let name = if param < 0 {
            m.name.as_str()
        } else {
            match usize::try_from(param).ok().and_then(|p| m.params.get(p)) {
                Some(p) => p.name.as_str(),
                None => return 0,
            }
        };
        // SAFETY: buf is NULL or has cap writable bytes (caller contract).
        unsafe { write_c_string(name, buf, cap) }
    })
}

/// Parses the prompt `xml[0..xml_len]` (UTF-8) against `schema` and lays it
/// out: `segments[0..*n_segments]` in the order the engine concatenates
/// them, and every segment's token ids in `tokens[0..*n_tokens]` (segment
/// i's at `tokens_offset`, `len` of them). Arguments and prompt text are
/// tokenized with `tokenize` (NULL: one token per byte; use the tokenizer
/// the schema was registered with).
///
/// MARCONI_STATUS_BUFFER_TOO_SMALL: writes only the needed counts to
/// `*n_segments` and `*n_tokens`. MARCONI_STATUS_INVALID_ARGUMENT: the
/// prompt is not UTF-8 or not valid PML for this schema (`*err`, when not
/// NULL, gets the line, column and reason), or the tokenizer failed.
/// MARCONI_STATUS_EMPTY_TOKENS: `xml_len` is 0.
///
/// Thread safety: any number of threads per schema.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_layout(
    schema: *const marconi_pml_schema,
    xml: *const u8,
    xml_len: usize,
    tokenize: marconi_pml_tokenize_fn,
    user: *mut c_void,
    segments: *mut marconi_pml_segment,
    segments_cap: usize,
    n_segments: *mut usize,
    tokens: *mut u32,
    tokens_cap: usize,
    n_tokens: *mut usize,
    err: *mut marconi_pml_error,
) -> marconi_status {
    boundary("marconi_pml_layout", || {
        require!(schema);
        require!(xml, len = xml_len);
        require!(segments, cap = segments_cap);
        require!(n_segments);
        require!(tokens, cap = tokens_cap);
        require!(n_tokens);
        check_ptr!(schema);
        check_ptr!(n_segments);
        check_ptr!(n_tokens);
        if xml_len == 0 {
            return Err(FfiError::new(marconi_status::EmptyTokens, "xml_len is 0"));
        }
        // SAFETY: a live handle (caller contract), checked non-NULL.
        let s = unsafe { schema_ref(schema) }?;
        // SAFETY: checked non-NULL; xml_len readable bytes by contract.
        let bytes = unsafe { in_slice(xml, xml_len, "xml") }?;
        // SAFETY: NULL only with capacity 0 (checked); writable by contract.
        let seg_out = unsafe { out_slice(segments, segments_cap, "segments") }?;
        // SAFETY: as above.
        let tok_out = unsafe { out_slice(tokens, tokens_cap, "tokens") }?;
        let text = document(bytes, err, "prompt")?;
        let prompt =
            Prompt::parse(text, s.enc.schema()).map_err(|e| pml_error(&e, err, "prompt"))?;
        let layout = with_tokenizer(tokenize, user, |t| s.enc.layout(&prompt, t))?
            .map_err(|e| pml_error(&e, err, "prompt"))?;
        let need_tokens: usize = layout.segments.iter().map(|g| g.tokens.len()).sum();
        let need_segments = layout.segments.len();
        if need_segments > seg_out.len() || need_tokens > tok_out.len() {
            // SAFETY: checked non-NULL and aligned; writable by contract.
            unsafe {
                n_segments.write(need_segments);
                n_tokens.write(need_tokens);
            }
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!(
                    "{need_segments} segments and {need_tokens} tokens needed; the buffers hold {} and {}",
                    seg_out.len(),
                    tok_out.len()
                ),
            ));
        }
        let mut at = 0usize;
        for (g, o) in layout.segments.iter().zip(seg_out.iter_mut()) {
            let module = g
                .module
                .map_or(-1, |m| i32::try_from(m.0).unwrap_or(i32::MAX));
            let param = match (g.kind, g.module) {
                (SegmentKind::Param, Some(m)) => s
                    .enc
                    .schema()
                    .module(m)
                    .params
                    .iter()
                    .position(|p| Some(&p.name) == g.name.as_ref())
                    .map_or(-1, |p| i32::try_from(p).unwrap_or(i32::MAX)),
                _ => -1,
            };
            *o = marconi_pml_segment {
                kind: match g.kind {
                    SegmentKind::Module => marconi_pml_segment_kind::Module,
                    SegmentKind::Anonymous => marconi_pml_segment_kind::Anonymous,
                    SegmentKind::Param => marconi_pml_segment_kind::Param,
                    SegmentKind::Text => marconi_pml_segment_kind::Text,
                },
                cached: g.cached,
                start: g.start,
                len: g.len,
                module,
                param,
                tokens_offset: at,
            };
            tok_out[at..at + g.tokens.len()].copy_from_slice(&g.tokens);
            at += g.tokens.len();
        }
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe {
            n_segments.write(need_segments);
            n_tokens.write(need_tokens);
        }
        Ok(())
    })
}
