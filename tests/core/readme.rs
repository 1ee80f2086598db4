//! The README's quick start is `examples/quickstart.rs`, byte for byte, so
//! that the code a reader copies is the code `cargo run --example ...` builds
//! (the README's blocks are compiled as doc tests too, through
//! `ReadmeDoctests` in `src/lib.rs`, and the guides' through `src/guide.rs`).
//! The README stays short and keeps the two commands `.ci/run` relies on;
//! every guide is included into rustdoc; the contributors' file map names
//! every source file; every `[dependencies]` block a user copies names
//! real features and every crate of the workspace its example uses; and
//! every repository path the README and `docs/` write in backticks exists.

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

/// At most 250 lines (the long form lives in `docs/guide/`), with the two
/// commands a newcomer needs; `.ci/run` runs the second.
#[test]
fn readme_is_short_and_has_the_two_commands() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; move detail to docs/guide/"
    );
    for command in [
        "\ncargo run --example ledger ",
        "\ncargo test --features client,admin ",
    ] {
        assert!(
            readme.contains(command),
            "README.md lost `{}`",
            command.trim()
        );
    }
    // `.ci/run` runs the same command; it is not in the published package,
    // whose tests run from the unpacked `.crate` without it.
    let ci = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/run");
    if ci.exists() {
        // As it stands, or under `.ci/run`'s time limit (`bounded SECONDS`).
        let runs_it = read(".ci/run").lines().any(|line| {
            let line = match line.strip_prefix("bounded ") {
                Some(rest) => rest
                    .trim_start_matches(|c: char| c.is_ascii_digit())
                    .trim_start(),
                None => line,
            };
            line == "cargo test --features client,admin"
        });
        assert!(runs_it, ".ci/run does not run the README's test command");
    }
}

/// Every `docs/guide/*.md` is included by `src/guide.rs`, and every store
/// crate's `docs/*.md` by its `lib.rs`, so its examples are compiled and
/// rustdoc shows it; every guide the README links to exists.
#[test]
fn every_guide_is_in_rustdoc() {
    let wiring = read("src/guide.rs");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/guide");
    let mut guides = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            guides += 1;
            let include = format!("include_str!(\"../docs/guide/{name}\")");
            assert!(
                wiring.contains(&include),
                "src/guide.rs does not include docs/guide/{name}"
            );
        }
    }
    assert!(guides >= 7, "{guides} guides");
    // Each store crate's long form (`crates/*/docs/*.md`) is included by its
    // `lib.rs` (the repository only: the published core has no `crates/`).
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    if crates.is_dir() {
        for krate in std::fs::read_dir(&crates).unwrap() {
            let krate = krate.unwrap().path();
            let Ok(docs) = std::fs::read_dir(krate.join("docs")) else {
                continue;
            };
            let lib = std::fs::read_to_string(krate.join("src/lib.rs")).unwrap();
            for entry in docs {
                let name = entry.unwrap().file_name().into_string().unwrap();
                assert!(
                    lib.contains(&format!("include_str!(\"../docs/{name}\")")),
                    "{}/src/lib.rs does not include docs/{name}",
                    krate.display()
                );
            }
        }
    }
    let readme = read("README.md");
    for link in readme.split("](docs/guide/").skip(1) {
        let target = &link[..link.find(')').unwrap()];
        if !target.is_empty() {
            assert!(
                dir.join(target).is_file(),
                "README links to docs/guide/{target}, which is missing"
            );
        }
    }
}

/// `docs/architecture.md` names every file under `src/` and `crates/*/src/`,
/// and no other.
#[test]
fn architecture_lists_every_source_file() {
    let map = read("docs/architecture.md");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The store crates' sources too, where they are beside this package
    // (the repository; not the published `.crate`).
    let crates = root.join("crates");
    let mut stack = vec![root.join("src")];
    if crates.is_dir() {
        for entry in std::fs::read_dir(&crates).unwrap() {
            stack.push(entry.unwrap().path().join("src"));
        }
    }
    let mut files = 0;
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            files += 1;
            let relative = path
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .replace('\\', "/");
            let named = if relative.starts_with("crates/redis/src/") && relative.ends_with(".lua") {
                // The Lua scripts share one line: `crates/redis/src/*.lua` and each name.
                let name = relative.rsplit('/').next().unwrap();
                map.contains("`crates/redis/src/*.lua`") && map.contains(&format!("`{name}`"))
            } else {
                map.contains(&format!("`{relative}`"))
            };
            assert!(named, "docs/architecture.md does not name {relative}");
        }
    }
    // The core alone holds 49 (the published `.crate`); with the crates, more.
    assert!(files >= 45, "{files} files under src/");
    // And names none that is gone.
    for named in map.split('`').filter(|s| {
        (s.starts_with("src/") || (s.starts_with("crates/") && crates.is_dir())) && !s.contains('*')
    }) {
        assert!(
            root.join(named).exists(),
            "docs/architecture.md names {named}, which is gone"
        );
    }
}

#[test]
fn quick_start_teaches_no_shared_fallback_scope() {
    let example = read("examples/quickstart.rs");
    assert!(!example.contains("\"anonymous\""));
    assert!(!example.contains("\"unauthenticated\""));
    assert!(!example.contains("GlobalScope"));
}

/// The text of a doc: a Markdown file, or the `//!` lines of a Rust file.
fn doc_text(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    if path.extension().is_some_and(|e| e == "rs") {
        text.lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        text
    }
}

/// The features a crate of this workspace declares, from its `Cargo.toml`
/// (`None` where that crate is not beside this package, as in the
/// published `.crate`).
fn features_of(root: &Path, package: &str) -> Option<Vec<String>> {
    let manifest = match package.strip_prefix("tower-idempotency-") {
        Some(name) => root.join("crates").join(name).join("Cargo.toml"),
        None => root.join("Cargo.toml"),
    };
    let text = std::fs::read_to_string(manifest).ok()?;
    let section = &text[text.find("\n[features]\n")? + 12..];
    let section = &section[..section.find("\n[").unwrap_or(section.len())];
    Some(
        section
            .lines()
            .filter_map(|l| Some(l.split_once(" = ")?.0.trim().to_owned()))
            .filter(|name| !name.starts_with('#'))
            .collect(),
    )
}

/// Every `[dependencies]` block of the docs, as a new user copies it: each
/// feature it asks of a crate of this workspace exists, and it lists every
/// crate of this workspace that the Rust block after it uses.
#[test]
fn dependency_blocks_name_real_features_and_every_crate_used() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        for krate in crates {
            let krate = krate.unwrap().path();
            docs.push(krate.join("README.md"));
            docs.push(krate.join("src/lib.rs"));
            dirs.push(krate.join("docs"));
        }
    }
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                docs.push(path);
            }
        }
    }
    let mut blocks = 0;
    for doc in docs.iter().filter(|d| d.exists()) {
        let text = doc_text(doc);
        let name = doc.strip_prefix(root).unwrap().display();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("```toml\n") {
            let block = &rest[at + 8..];
            let end = block.find("```").expect("a closing fence");
            let (toml, after) = (&block[..end], &block[end + 3..]);
            rest = after;
            if !toml.contains("[dependencies]") {
                continue;
            }
            blocks += 1;
            let mut listed = Vec::new();
            for line in toml.lines() {
                let Some((package, spec)) = line.split_once(" = ") else {
                    continue;
                };
                let package = package.trim();
                if !package.starts_with("tower-idempotency") {
                    continue;
                }
                listed.push(package.to_owned());
                let spec = spec.split('#').next().unwrap();
                let Some(features) = spec.split_once("features = [") else {
                    continue;
                };
                let features = &features.1[..features.1.find(']').unwrap()];
                let Some(declared) = features_of(root, package) else {
                    continue;
                };
                for feature in features.split(',').map(|f| f.trim().trim_matches('"')) {
                    assert!(
                        declared.iter().any(|d| d == feature),
                        "{name}: {package} has no feature {feature:?} (it has {declared:?})"
                    );
                }
            }
            // The Rust block that follows, before any other block of
            // dependencies.
            let code = after
                .find("```rust")
                .filter(|&r| after.find("```toml").is_none_or(|t| r < t))
                .map(|r| {
                    let code = &after[r..];
                    let body = &code[code.find('\n').unwrap()..];
                    &body[..body.find("```").unwrap()]
                });
            for used in code
                .unwrap_or("")
                .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            {
                if let Some(package) = used
                    .strip_prefix("tower_idempotency")
                    .map(|tail| format!("tower-idempotency{}", tail.replace('_', "-")))
                {
                    assert!(
                        listed.contains(&package),
                        "{name}: the example uses {used}, and the [dependencies] above it do not list {package}"
                    );
                }
            }
        }
    }
    // The README's alone in the published `.crate`; with the store crates'
    // READMEs and guides beside it, more.
    let expected = if root.join("crates").is_dir() { 6 } else { 1 };
    assert!(blocks >= expected, "{blocks} dependency blocks found");
}

/// The inline code spans of a Markdown text, fenced blocks left out: the
/// text between a run of backticks and the next run of as many.
fn code_spans(text: &str) -> Vec<&str> {
    let mut prose = Vec::new();
    let mut fenced = false;
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        let at = start;
        start += line.len();
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            prose.push(at..start);
        }
    }
    let mut spans = Vec::new();
    // Consecutive prose lines form one stretch, so a span may cross a line.
    let mut stretches: Vec<std::ops::Range<usize>> = Vec::new();
    for range in prose {
        match stretches.last_mut() {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => stretches.push(range),
        }
    }
    for stretch in stretches {
        let mut rest = &text[stretch];
        while let Some(open) = rest.find('`') {
            let ticks = rest[open..].len() - rest[open..].trim_start_matches('`').len();
            let body = &rest[open + ticks..];
            let fence = &rest[open..open + ticks];
            // The closing run: as many backticks, not part of a longer run.
            let mut search = 0;
            let close = loop {
                let Some(at) = body[search..].find(fence).map(|a| a + search) else {
                    break None;
                };
                let run = body[at..].len() - body[at..].trim_start_matches('`').len();
                if run == ticks {
                    break Some(at);
                }
                search = at + run;
            };
            match close {
                Some(close) => {
                    spans.push(&body[..close]);
                    rest = &body[close + ticks..];
                }
                None => rest = body,
            }
        }
    }
    spans
}

/// Whether at least one path under `root` matches `path` (`*`, `?` and `**`
/// as the `glob` crate reads them); a trailing `/` asks for a directory.
fn glob_matches(root: &Path, path: &str) -> bool {
    let directory = path.ends_with('/');
    let pattern = root.join(path.trim_end_matches('/'));
    glob::glob(&pattern.to_string_lossy())
        .expect("a valid glob")
        .flatten()
        .any(|found| !directory || found.is_dir())
}

/// Every repository path the README and `docs/**/*.md` write in backticks
/// (`src/...`, `crates/...`, `tests/...`, `examples/...`, `bench/...`,
/// `docs/...`, `proof/...`, `fuzz/...`, `.ci/...`, `integration/...`)
/// exists; a glob
/// (`tests/*_faults.rs`) matches at least one file, a path with a
/// `<placeholder>` is not checked. A span that is a command checks its
/// first word (`fuzz/run 10`); `::item`, `#anchor` and `:line` are cut.
/// In the published `.crate` only `src/` and `docs/` are checked: the
/// rest of the repository is not in it.
#[test]
fn every_path_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let repository = root.join("crates").is_dir();
    let prefixes: &[&str] = if repository {
        &[
            "src/",
            "crates/",
            "tests/",
            "examples/",
            "bench/",
            "docs/",
            "proof/",
            "fuzz/",
            ".ci/",
        ]
    } else {
        &["src/", "docs/"]
    };
    let mut docs = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                docs.push(path);
            }
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let name = doc
            .strip_prefix(root)
            .unwrap()
            .to_str()
            .unwrap()
            .replace('\\', "/");
        for span in code_spans(&text) {
            let Some(word) = span.split_whitespace().next() else {
                continue;
            };
            if !prefixes.iter().any(|p| word.starts_with(p)) || word.contains('<') {
                continue;
            }
            let path = word.split("::").next().unwrap();
            let path = path.split(['#', ':']).next().unwrap();
            checked += 1;
            if !glob_matches(root, path) {
                let offset = span.as_ptr() as usize - text.as_ptr() as usize;
                let line = text[..offset].matches('\n').count() + 1;
                missing.push(format!("{name}:{line}: `{path}`"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths the docs name that are not in the repository:\n  {}",
        missing.join("\n  ")
    );
    assert!(checked >= 20, "{checked} paths checked");
}
