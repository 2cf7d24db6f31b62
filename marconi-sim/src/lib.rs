//! marconi-sim: see ARCHITECTURE.md.
