#!/usr/bin/env bash
# Plants a bug in a scratch copy of the repository, one at a time, and fails
# unless the real-store harness catches each (a failing seed on the stores
# the bug concerns). tests/simulation/mutations.sh does the same for the
# simulation. Needs the servers of `cargo test --all-features`.
# Run from anywhere: tests/real_stores/mutations.sh [SEEDS, default 8] [NAME...]
# (each mutation runs seeds 1..SEEDS, and stops at its first failing seed;
# NAMEs: only those mutations; `none` is the unmutated code.)
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
seeds="${1:-8}"
shift || true
only=" $* "
# shellcheck source=tests/common/plant.sh
source "$repo/tests/common/plant.sh"
# One target directory for every mutant: each rebuilds what its file touches.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}/real-mutants"

failed=0
# run NAME STORES [FILE OLD NEW]... (each triple planted)
run() {
    local name=$1 stores=$2
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
        return
    fi
    shift 2
    fresh_copy
    while [ "$#" -ge 3 ]; do
        plant "$1" "$2" "$3" || { echo "=== mutation $name: could not be planted"; failed=$((failed + 1)); return; }
        shift 3
    done
    (cd "$scratch/p" && cargo build --quiet --all-features -p integration --example ledger --test real_stores) ||
        { echo "=== mutation $name: does not build"; failed=$((failed + 1)); return; }
    local out rc seed caught=""
    for seed in $(seq 1 "$seeds"); do
        out=$(cd "$scratch/p" && REAL_SEED=$seed REAL_STORES=$stores \
            cargo test --quiet --all-features -p integration --test real_stores 2>/dev/null)
        rc=$?
        if [ "$rc" -ne 0 ]; then
            caught=$seed
            break
        fi
    done
    if [ "$name" = none ]; then
        if [ -z "$caught" ]; then echo "=== unmutated: passes $seeds seeds on $stores"; else
            echo "=== unmutated: FAILS seed $caught on $stores"; grep -A8 'FAILED' <<<"$out"; failed=$((failed + 1)); fi
    elif [ -n "$caught" ] && grep -q 'FAILED' <<<"$out"; then
        echo "=== mutation $name: CAUGHT at seed $caught of $seeds on $stores"
        grep -A4 'FAILED' <<<"$out" | cut -c1-300
    else
        echo "=== mutation $name: NOT CAUGHT in $seeds seeds on $stores (exit $rc)"
        failed=$((failed + 1))
    fi
}

# Issue 36, item 1: a claim in SqliteStore's writer takes over a key whose
# holder is open in the same batch once its lease has run out.
run live-holder-taken-over sqlite/transactional src/store/sqlite/claim.rs \
    "Some(left) if taken_over => return Ok(Found::Refused(Refused::InFlight(left)))," \
    "Some(left) if taken_over && left.is_zero() => return Ok(Found::Refused(Refused::InFlight(left))),"
# Every store: a lease is judged alive only while more than 1.5 s of it
# is left, so a repeat between two renewals takes over a live holder.
run takeover-while-lease-alive postgres/separate,mysql/transactional src/store/decide.rs \
    "} else if lease_alive(existing.lease_until, now, lease) {" \
    "} else if lease_alive(existing.lease_until, now + 1500, lease) {"
# Issue 36, item 5: the ledger writes in separate mode without fencing:
# no confirmation of its claim first, no race against a lost lease, and no
# credit found by its key across processes (the key's hash made per
# process), so a holder paused past its lease, or killed after its write,
# writes a second credit.
run unfenced-write sqlite/separate,postgres/separate,mysql/separate examples/ledger/main.rs \
    "claimed.confirm().await.map_err(ApiError::NotConfirmed)?;
                let lost = claimed.lease_lost();" \
    "let _ = ApiError::NotConfirmed;
                let lost = std::future::pending::<()>();" \
    examples/ledger/main.rs \
    "    hex(&hash.finalize())
}" \
    "    format!(\"{}-{}\", hex(&hash.finalize()[..24]), std::process::id())
}"
run none sqlite,postgres
if [ "$failed" -ne 0 ]; then
    echo "real-store mutations: $failed problem(s)"
    exit 1
fi
echo "real-store mutations: every one run was caught; the unmutated code passes (if run)"
