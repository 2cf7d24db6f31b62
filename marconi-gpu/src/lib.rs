//! marconi-gpu: see ARCHITECTURE.md.
