//! The committed `include/marconi.h` must be exactly what the pinned cbindgen
//! generates from this crate, with version macros from Cargo.toml.
//! `MARCONI_BLESS=1` rewrites it.

use std::ffi::CStr;
use std::path::PathBuf;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn header_path() -> PathBuf {
    crate_dir().join("../include/marconi.h")
}

/// The version macros, from this crate's Cargo.toml version.
fn version_macros() -> String {
    let v = env!("CARGO_PKG_VERSION");
    let mut parts = v.split(['.', '-', '+']);
    let mut next = || parts.next().expect("semver has three parts");
    let (major, minor, patch) = (next(), next(), next());
    format!(
        "\n/** Version of this header (from Cargo.toml); compare with marconi_version(). */\n\
         #define MARCONI_VERSION_MAJOR {major}\n\
         /** Minor version of this header. */\n\
         #define MARCONI_VERSION_MINOR {minor}\n\
         /** Patch version of this header. */\n\
         #define MARCONI_VERSION_PATCH {patch}\n\
         /** \"MAJOR.MINOR.PATCH\". */\n\
         #define MARCONI_VERSION_STRING \"{v}\"\n"
    )
}

/// `marconi_status_ALL`, an initialiser of every status in value order,
/// from `marconi_status::ALL` (cbindgen would spell the elements with the
/// Rust variant names, which C does not know).
fn status_all_macro() -> String {
    let names: Vec<String> = marconi::marconi_status::ALL
        .iter()
        .map(|s| {
            let mut c = String::from("MARCONI_STATUS");
            for ch in format!("{s:?}").chars() {
                if ch.is_ascii_uppercase() {
                    c.push('_');
                }
                c.push(ch.to_ascii_uppercase());
            }
            c
        })
        .collect();
    format!(
        "\n/**\n * Every marconi_status, in value order, as an array initialiser:\n \
         * `static const marconi_status all[] = marconi_status_ALL;`\n */\n\
         #define marconi_status_ALL {{ {} }}",
        names.join(", ")
    )
}

fn generate() -> String {
    let mut config =
        cbindgen::Config::from_file(crate_dir().join("cbindgen.toml")).expect("cbindgen.toml");
    // cbindgen.toml's own after_includes (the deprecation macro) first.
    let own = config.after_includes.take().unwrap_or_default();
    config.after_includes = Some(version_macros() + &status_all_macro() + "\n" + &own);
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir().join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn header_is_fresh() {
    let fresh = generate();
    let path = header_path();
    if std::env::var_os("MARCONI_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &fresh).expect("write include/marconi.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let tmp = std::env::temp_dir().join("marconi.h.fresh");
        std::fs::write(&tmp, &fresh).expect("write temp header");
        let first = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(fresh.lines().count()));
        panic!(
            "include/marconi.h is stale (first difference at line {}).\n\
             See: diff -u include/marconi.h {}\n\
             Regenerate: MARCONI_BLESS=1 cargo test --release -p marconi-ffi --test header",
            first + 1,
            tmp.display()
        );
    }
}

#[test]
fn header_documents_every_function() {
    let header = std::fs::read_to_string(header_path()).expect("include/marconi.h");
    let lines: Vec<&str> = header.lines().collect();
    let mut functions = 0;
    for (i, line) in lines.iter().enumerate() {
        let prototype = line.contains(" marconi_")
            && line.contains('(')
            && !line.starts_with([' ', '/', '#', '*']);
        if prototype {
            functions += 1;
            // The doc comment stands above the prototype and its attribute.
            let above = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty() && !l.starts_with("MARCONI_DEPRECATED("));
            assert!(
                above.is_some_and(|l| l.trim_end().ends_with("*/")),
                "no doc comment above line {}: {line}",
                i + 1
            );
        }
    }
    assert!(functions >= 15, "found only {functions} prototypes");
}

#[test]
fn version_macros_match_the_library() {
    let header = std::fs::read_to_string(header_path()).expect("include/marconi.h");
    let mac = |name: &str| -> String {
        let prefix = format!("#define {name} ");
        header
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{name} missing from the header"))
            .trim()
            .to_owned()
    };
    // SAFETY: marconi_version returns a static NUL-terminated string.
    let lib = unsafe { CStr::from_ptr(marconi::marconi_version()) }
        .to_str()
        .expect("UTF-8 version");
    assert_eq!(lib, env!("CARGO_PKG_VERSION"));
    assert_eq!(mac("MARCONI_VERSION_STRING"), format!("\"{lib}\""));
    let dotted = format!(
        "{}.{}.{}",
        mac("MARCONI_VERSION_MAJOR"),
        mac("MARCONI_VERSION_MINOR"),
        mac("MARCONI_VERSION_PATCH")
    );
    assert!(lib.starts_with(&dotted), "{dotted} vs {lib}");
}
