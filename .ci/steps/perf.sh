#!/usr/bin/env bash
# The benchmarks keep compiling: the load benchmark (bench/) and the naive
# ledger that bench/ledger/compare.sh measures the ledger example against.
# Each is a Cargo project of its own (not in the crate's workspace), so
# nothing else builds them. Checks only; the measurements are run by hand
# (BENCHMARKS.md), since wall-clock figures are never asserted in CI.
set -euo pipefail
cargo check --manifest-path bench/Cargo.toml
cargo check --manifest-path bench/naive-ledger/Cargo.toml
for s in bench/ledger/*.sh; do bash -n "$s"; done
