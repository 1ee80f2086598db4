//! The README's quick start is `examples/quickstart.rs`, and its sqlx
//! section `examples/sqlx_postgres.rs`, byte for byte, so that the code a
//! reader copies is the code `cargo run --example ...` builds (the
//! README's blocks are compiled as doc tests too, through `ReadmeDoctests`
//! in `src/lib.rs`).

use std::path::Path;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The body of the first fenced block that opens with `fence` after `heading`.
fn block_after<'a>(text: &'a str, heading: &str, fence: &str) -> &'a str {
    let section = &text[text.find(heading).expect("the heading") + heading.len()..];
    let start = section.find(fence).expect("the fence") + fence.len();
    let body = &section[start..];
    &body[..body.find("\n```\n").expect("the closing fence") + 1]
}

#[test]
fn quick_start_is_the_quickstart_example() {
    let readme = read("README.md");
    let block = block_after(&readme, "\n## Quick start\n", "```rust,no_run\n");
    assert_eq!(block, read("examples/quickstart.rs"));
}

/// The same for the sqlx section and `examples/sqlx_postgres.rs` (an
/// `ignore` block: it needs the `sqlx-postgres` feature, which the doc tests
/// of the README do not have; the example itself is built with it).
#[test]
fn sqlx_section_is_the_sqlx_postgres_example() {
    let readme = read("README.md");
    let block = block_after(&readme, "\n## With sqlx\n", "```rust,ignore\n");
    assert_eq!(block, read("examples/sqlx_postgres.rs"));
}

#[test]
fn quick_start_teaches_no_shared_fallback_scope() {
    let example = read("examples/quickstart.rs");
    assert!(!example.contains("\"anonymous\""));
    assert!(!example.contains("\"unauthenticated\""));
    assert!(!example.contains("GlobalScope"));
}
