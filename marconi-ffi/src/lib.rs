//! marconi-ffi: see ARCHITECTURE.md.
