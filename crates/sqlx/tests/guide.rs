//! The PostgreSQL page of the guide shows `examples/postgres.rs` byte for
//! byte, so the code a reader copies is the code `cargo run --example
//! postgres` builds (the page's block is compiled as a doc test too, in
//! `guide::postgres`, with the feature `postgres`).

use std::path::Path;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_postgres_guide_is_the_postgres_example() {
    let guide = read("docs/postgres.md");
    let heading = "\n## PostgreSQL\n";
    let section = &guide[guide.find(heading).expect("the heading") + heading.len()..];
    let fence = "```rust,no_run\n";
    let body = &section[section.find(fence).expect("the fence") + fence.len()..];
    let block = &body[..body.find("\n```\n").expect("the closing fence") + 1];
    assert_eq!(block, read("examples/postgres.rs"));
}
