//! Gives the ELF shared library a SONAME, so that programs linked against it
//! record `libmarconi.so.<abi>` and refuse an ABI-incompatible install.

fn main() {
    // Follows the ABI policy in docs/c-abi.md: within 0.x a minor version keeps
    // the ABI, from 1.0 a major version does (cargo-c's convention too).
    let major = env("CARGO_PKG_VERSION_MAJOR");
    let abi = if major == "0" {
        format!("0.{}", env("CARGO_PKG_VERSION_MINOR"))
    } else {
        major
    };
    // ELF targets only: Mach-O (install_name) and PE have no SONAME.
    let os = env("CARGO_CFG_TARGET_OS");
    if !matches!(os.as_str(), "macos" | "ios" | "windows") {
        println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libmarconi.so.{abi}");
    }
    println!("cargo::rerun-if-changed=build.rs");
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("cargo sets {name} for build scripts"))
}
