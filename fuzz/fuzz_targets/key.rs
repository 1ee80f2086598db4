#![no_main]
//! libFuzzer target: `check_key` of `integration/tests/fuzz_checks`, shared with the corpus replay
//! of `integration/tests/stores/fuzz_corpus.rs`.

#[path = "../../integration/tests/fuzz_checks/mod.rs"]
#[allow(dead_code)]
mod checks;

#[global_allocator]
static ALLOC: checks::CountingAlloc = checks::CountingAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check_key(data));
