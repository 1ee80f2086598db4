//! Never published, and no library: this package holds the ledger
//! (`examples/ledger/`, the main job), the benchmarks (`bench/`) and the tests
//! that need more than one crate of the workspace (each named in
//! `integration/Cargo.toml`). `docs/testing.md` says what each needs.
