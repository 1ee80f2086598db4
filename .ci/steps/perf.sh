#!/usr/bin/env bash
# The benchmarks keep compiling: the load benchmark (bench/), the naive
# ledger that bench/ledger/compare.sh measures the ledger example against,
# and the replay-size server of bench/ledger/scale.sh sizes.
# Each is a Cargo project of its own (not in the crate's workspace), so
# nothing else builds them. Checks only; the measurements are run by hand
# (BENCHMARKS.md), since wall-clock figures are never asserted in CI.
set -euo pipefail
# One target directory, the workspace's: the three share most of their
# dependencies with it and with each other, which are then checked once.
cargo check --manifest-path bench/Cargo.toml --target-dir target
cargo check --manifest-path bench/naive-ledger/Cargo.toml --target-dir target
cargo check --manifest-path bench/replay-size/Cargo.toml --target-dir target
for s in bench/ledger/*.sh bench/prototypes/*/*.sh; do bash -n "$s"; done
for p in bench/ledger/*.py bench/prototypes/*/*.py; do python3 -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$p"; done
