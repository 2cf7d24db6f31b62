//! `marconi_model_spec_from_gguf`: a model's dimensions read from its GGUF
//! file (llama.cpp's format) by marconi-core's `gguf` module.

use std::ffi::{c_char, CStr};
use std::io::Read;

use marconi_core::{GgufError, ModelSpec};

use crate::config::marconi_model_spec;
use crate::status::{boundary, check_ptr, in_slice, marconi_status, require, FfiError, FfiResult};

/// The most bytes read from the start of a file looking for the end of its
/// metadata (a large vocabulary takes a few MiB; tensor data is never read).
const MAX_METADATA_BYTES: u64 = 256 << 20;

fn spec_error(e: GgufError) -> FfiError {
    let status = match e {
        GgufError::Truncated(_) | GgufError::Malformed(_) => marconi_status::InvalidArgument,
        _ => marconi_status::InvalidConfig,
    };
    FfiError::new(status, e.to_string())
}

fn write_spec(m: &ModelSpec, out: *mut marconi_model_spec) {
    // SAFETY: out is non-NULL and aligned (checked by the caller of this
    // function) and writable by the exported functions' contract.
    unsafe { out.write(marconi_model_spec::from_core(m)) };
}

/// Reads the start of `file` until the GGUF metadata parses, doubling the
/// prefix from 1 MiB up to MAX_METADATA_BYTES.
fn spec_from_reader(mut file: impl Read, what: &str) -> FfiResult<ModelSpec> {
    let mut bytes: Vec<u8> = Vec::new();
    let mut want: u64 = 1 << 20;
    let mut eof = false;
    loop {
        if !eof {
            let mut chunk = Vec::new();
            let n = (&mut file)
                .take(want - bytes.len() as u64)
                .read_to_end(&mut chunk)
                .map_err(|e| {
                    FfiError::new(
                        marconi_status::InvalidArgument,
                        format!("{what}: read failed: {e}"),
                    )
                })?;
            eof = bytes.len() as u64 + (n as u64) < want;
            bytes.extend_from_slice(&chunk);
        }
        match ModelSpec::from_gguf(&bytes) {
            Err(GgufError::Truncated(_)) if !eof && want < MAX_METADATA_BYTES => {
                want = (want * 2).min(MAX_METADATA_BYTES);
            }
            Err(GgufError::Truncated(at)) if eof => {
                return Err(FfiError::new(
                    marconi_status::InvalidArgument,
                    format!("{what}: the file ends at byte {at}, inside its GGUF metadata"),
                ))
            }
            Err(GgufError::Truncated(_)) => {
                return Err(FfiError::new(
                    marconi_status::InvalidArgument,
                    format!("{what}: GGUF metadata larger than {MAX_METADATA_BYTES} bytes"),
                ))
            }
            Err(e) => {
                let mut e = spec_error(e);
                e.detail = format!("{what}: {}", e.detail);
                return Err(e);
            }
            Ok(m) => return Ok(m),
        }
    }
}

/// Opens `path` for reading if it is a regular file, without ever blocking:
/// the open is non-blocking (a FIFO without a writer would otherwise block
/// the open, and one with a writer the reads, for ever) and the type is
/// checked on the opened file, so a path swapped between a check and the
/// open cannot slip through. Directories, FIFOs, sockets and devices
/// (`/dev/zero`) are refused with MARCONI_STATUS_INVALID_ARGUMENT.
pub(crate) fn open_regular(path: &std::path::Path, shown: &str) -> FfiResult<std::fs::File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    // Miri's `open` supports no such flags (and has no FIFOs to block on):
    // under Miri the type check below still refuses what is not a file.
    #[cfg(all(unix, not(miri)))]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    }
    let file = opts.open(path).map_err(|e| {
        FfiError::new(
            marconi_status::InvalidArgument,
            format!("{shown}: cannot open: {e}"),
        )
    })?;
    let kind = file
        .metadata()
        .map_err(|e| {
            FfiError::new(
                marconi_status::InvalidArgument,
                format!("{shown}: cannot read its type: {e}"),
            )
        })?
        .file_type();
    if !kind.is_file() {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("{shown}: not a regular file ({})", describe(kind)),
        ));
    }
    Ok(file)
}

/// A file type in words, for the error.
fn describe(kind: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_socket() {
            return "a socket";
        }
        if kind.is_char_device() || kind.is_block_device() {
            return "a device";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}

/// Writes into `*out` the dimensions of the model in the GGUF file at `path`
/// (NUL-terminated, any bytes the OS accepts), read from the file's header
/// and metadata only (at most 256 MiB of it; tensor data is never read).
///
/// Architectures: nemotron_h, nemotron_h_moe, granitehybrid, falcon-h1,
/// mamba2, mamba, llama, qwen2, qwen3 (layer kinds by llama.cpp's own
/// rules). Sizes are those llama.cpp stores: KV in f16 (its default cache
/// type; set dtype_bytes for another), recurrent states in f32, the conv
/// state with conv_kernel - 1 columns.
///
/// MARCONI_STATUS_INVALID_ARGUMENT: the file cannot be opened or read, is
/// not a regular file (a directory, FIFO, socket or device: refused without
/// blocking), is not GGUF, or breaks the format; MARCONI_STATUS_INVALID_CONFIG: it is
/// GGUF but its architecture is not supported, a key is missing or
/// impossible, or the model it describes cannot drive a cache. The detail
/// (marconi_last_error) names the path and the key. `*out` is written only
/// on success.
///
/// Thread safety: touches only `*out`; reads the file.
#[no_mangle]
pub unsafe extern "C" fn marconi_model_spec_from_gguf(
    path: *const c_char,
    out: *mut marconi_model_spec,
) -> marconi_status {
    boundary("marconi_model_spec_from_gguf", || {
        require!(path);
        require!(out);
        check_ptr!(path);
        check_ptr!(out);
        // SAFETY: path is non-NULL and NUL-terminated by contract.
        let raw = unsafe { CStr::from_ptr(path) };
        let shown = raw.to_string_lossy();
        #[cfg(unix)]
        let path = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(raw.to_bytes());
        #[cfg(not(unix))]
        let path = raw.to_str().map_err(|_| {
            FfiError::new(
                marconi_status::InvalidArgument,
                format!("{shown}: path is not UTF-8"),
            )
        })?;
        let file = open_regular(std::path::Path::new(path), &shown)?;
        let m = spec_from_reader(file, &shown)?;
        write_spec(&m, out);
        Ok(())
    })
}

/// Like marconi_model_spec_from_gguf, from the first `len` bytes of a GGUF
/// file already in memory (at least up to the end of its metadata).
///
/// Thread safety: reads `bytes`, touches only `*out`.
#[no_mangle]
pub unsafe extern "C" fn marconi_model_spec_from_gguf_bytes(
    bytes: *const u8,
    len: usize,
    out: *mut marconi_model_spec,
) -> marconi_status {
    boundary("marconi_model_spec_from_gguf_bytes", || {
        require!(bytes, len = len);
        require!(out);
        check_ptr!(out);
        // SAFETY: bytes is NULL with len 0 (checked) or has len readable
        // bytes by contract.
        let b = unsafe { in_slice(bytes, len, "bytes") }?;
        let m = ModelSpec::from_gguf(b).map_err(spec_error)?;
        write_spec(&m, out);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 header with the given string and u32 keys.
    fn gguf(strs: &[(&str, &str)], u32s: &[(&str, u32)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&((strs.len() + u32s.len()) as u64).to_le_bytes());
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend_from_slice(&(x.len() as u64).to_le_bytes());
            b.extend_from_slice(x.as_bytes());
        };
        for (k, v) in strs {
            s(&mut b, k);
            b.extend_from_slice(&8u32.to_le_bytes());
            s(&mut b, v);
        }
        for (k, v) in u32s {
            s(&mut b, k);
            b.extend_from_slice(&4u32.to_le_bytes());
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn mamba2() -> Vec<u8> {
        gguf(
            &[("general.architecture", "mamba2")],
            &[
                ("mamba2.block_count", 2),
                ("mamba2.embedding_length", 64),
                ("mamba2.ssm.conv_kernel", 4),
                ("mamba2.ssm.inner_size", 128),
                ("mamba2.ssm.state_size", 16),
                ("mamba2.ssm.group_count", 1),
            ],
        )
    }

    #[test]
    fn bytes_and_file_give_the_spec() {
        let b = mamba2();
        let mut out = marconi_model_spec::default();
        // SAFETY: valid pointers and lengths.
        let st = unsafe { marconi_model_spec_from_gguf_bytes(b.as_ptr(), b.len(), &mut out) };
        assert_eq!(st, marconi_status::Ok);
        assert_eq!((out.ssm_layers, out.attn_layers), (2, 0));
        assert_eq!(
            (out.conv_channels, out.conv_kernel, out.state_dtype_bytes),
            (128 + 32, 3, 4)
        );

        let dir = std::env::temp_dir().join(format!("marconi-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        // Tensor data after the metadata is never read. (Under Miri a 3 MiB
        // tail took 7 of its 8 minutes on this crate in CI; 64 KiB shows the
        // same.)
        let tail = if cfg!(miri) { 64 << 10 } else { 3 << 20 };
        let mut file = b.clone();
        file.resize(b.len() + tail, 0xab);
        std::fs::write(&path, &file).unwrap();
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        let mut from_file = marconi_model_spec::default();
        // SAFETY: valid pointers.
        let st = unsafe { marconi_model_spec_from_gguf(c.as_ptr(), &mut from_file) };
        assert_eq!(st, marconi_status::Ok);
        assert_eq!(from_file, out);

        // Cut inside the metadata: an error naming the path, out untouched.
        std::fs::write(&path, &b[..b.len() - 3]).unwrap();
        let mut untouched = marconi_model_spec::default();
        // SAFETY: valid pointers.
        let st = unsafe { marconi_model_spec_from_gguf(c.as_ptr(), &mut untouched) };
        assert_eq!(st, marconi_status::InvalidArgument);
        assert_eq!(untouched, marconi_model_spec::default());
        let e = crate::status::last_error();
        assert!(
            e.contains("m.gguf") && e.contains("inside its GGUF metadata"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_arguments_are_refused() {
        let mut out = marconi_model_spec::default();
        // SAFETY: NULL pointers and a missing file are what is tested.
        unsafe {
            assert_eq!(
                marconi_model_spec_from_gguf(std::ptr::null(), &mut out),
                marconi_status::NullArgument
            );
            assert_eq!(
                marconi_model_spec_from_gguf(c"x".as_ptr(), std::ptr::null_mut()),
                marconi_status::NullArgument
            );
            assert_eq!(
                marconi_model_spec_from_gguf(c"/nonexistent/m.gguf".as_ptr(), &mut out),
                marconi_status::InvalidArgument
            );
            assert!(crate::status::last_error().contains("cannot open"));
            assert_eq!(
                marconi_model_spec_from_gguf_bytes(std::ptr::null(), 4, &mut out),
                marconi_status::NullArgument
            );
            assert_eq!(
                marconi_model_spec_from_gguf_bytes(std::ptr::null(), 0, &mut out),
                marconi_status::InvalidArgument
            );
            let b = b"GGUF\x01\0\0\0";
            assert_eq!(
                marconi_model_spec_from_gguf_bytes(b.as_ptr(), b.len(), &mut out),
                marconi_status::InvalidArgument
            );
            let b = gguf(&[("general.architecture", "rwkv7")], &[]);
            assert_eq!(
                marconi_model_spec_from_gguf_bytes(b.as_ptr(), b.len(), &mut out),
                marconi_status::InvalidConfig
            );
            assert!(crate::status::last_error().contains("unsupported GGUF architecture"));
        }
        assert_eq!(out, marconi_model_spec::default());
    }
}
