#!/usr/bin/env bash
# Plants each bug of issue 24 (item 3) and of issue 37 (one phase) in a
# scratch copy of the repository, one at a time, and fails unless the
# simulation catches every one (a failing seed, with its problems and its
# trace). proof/mutations.sh does the same for the model checker. Takes a
# release build per mutation. Half the seeds run each mode (even seeds two
# phases, odd seeds one phase): 600 seeds give each mode 300.
# Run from anywhere: tests/simulation/mutations.sh [SEEDS, default 600] [NAME...]
# (NAMEs: only those mutations; `none` is the unmutated code.)
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
seeds="${1:-600}"
shift || true
only=" $* "
# shellcheck source=tests/common/plant.sh
source "$repo/tests/common/plant.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}/sim-mutants"

failed=0
run() {
    local name=$1
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
        return
    fi
    fresh_copy
    shift
    if [ "$name" != none ]; then
        plant "$@" || { echo "=== mutation $name: could not be planted"; failed=$((failed + 1)); return; }
    fi
    local out rc
    out=$(cd "$scratch/p" && SIM_SEEDS="$seeds" cargo test --release --quiet -p integration --test simulation 2>&1)
    rc=$?
    if [ "$name" = none ]; then
        if [ "$rc" -eq 0 ]; then echo "=== unmutated: passes"; else echo "=== unmutated: FAILS"; failed=$((failed + 1)); fi
        grep '^simulation:' <<<"$out"
    elif [ "$rc" -ne 0 ] && grep -q '^seed [0-9]*: FAILED' <<<"$out"; then
        echo "=== mutation $name: CAUGHT"
        # The first failing seed, its problems, and its replay command.
        awk '/^seed [0-9]+: FAILED/{p=1; n++} n==2{exit} p' <<<"$out" | head -12
        grep '^simulation:' <<<"$out"
    else
        echo "=== mutation $name: NOT CAUGHT (exit $rc)"
        tail -5 <<<"$out"
        failed=$((failed + 1))
    fi
}

run complete-ignores-token src/store/memory.rs \
    "Some(record) if record.token == token && record.response.is_none() => {
                record.response = Some(response);" \
    "Some(record) if record.response.is_none() => {
                record.response = Some(response);"
run lease-trusts-stepped-clock src/store/decide.rs \
    "lease_until > now && lease_until - now <= super::duration_ms(lease)" \
    "lease_until > now && lease.as_millis() > 0"
run release-without-token src/store/memory.rs \
    "Some(record) if record.token == token && record.response.is_none() => {
                records.map.remove(&id);" \
    "Some(record) if record.response.is_none() => {
                records.map.remove(&id);"
run ack-before-send crates/outbox/src/relay.rs \
    "Outcome::Retry(error) => (Some(Ok(error)), Duration::ZERO)," \
    "Outcome::Retry(_) => (None, Duration::ZERO),"
run enqueue-outside-transaction tests/simulation/app.rs \
    "tx.messages.push(msg);" \
    "crate::wire::call(&Call::Enqueue { message: msg }).await?;"
run takeover-while-lease-alive src/store/decide.rs \
    "} else if lease_alive(existing.lease_until, now, lease) {" \
    "} else if lease_alive(existing.lease_until, now + 500, lease) {"
# Issue 37, one phase. The driver opens its transaction after the claim,
# which so commits at once, before the work: a crash leaves the key in
# flight, and other servers see the claim.
run one-phase-claim-committed-first tests/simulation/app.rs \
    "    session.call(&begin, wire::CALL_TIMEOUT).await?;
    let claimed = session.call(&claim, wire::CALL_TIMEOUT + wait).await?;" \
    "    let claimed = session.call(&claim, wire::CALL_TIMEOUT + wait).await?;
    session.call(&begin, wire::CALL_TIMEOUT).await?;"
# A claim's wait on another transaction's claim ignores its bound: it waits
# until the holder ends.
run wait-ignores-bound tests/simulation/store_one_phase.rs \
    "tokio::time::timeout_at(deadline, ended.changed())" \
    "tokio::time::timeout_at(deadline + Duration::from_secs(60), ended.changed())"
run none
if [ "$failed" -ne 0 ]; then
    echo "simulation mutations: $failed problem(s)"
    exit 1
fi
echo "simulation mutations: every one run was caught; the unmutated code passes (if run)"
