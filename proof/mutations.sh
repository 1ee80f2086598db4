#!/usr/bin/env bash
# Plants each bug of issue 24 (item 3) and issue 37 (one phase) in the
# model, one at a time, and fails unless the model checker catches every one
# with a counterexample, and the unmutated model passes. Each
# counterexample's trace is printed. A bug planted in one mode only leaves
# the other modes' checks out (they would check the unmutated model again).
# Run from anywhere: proof/mutations.sh
set -uo pipefail
cd "$(dirname "$0")/.."
mutations=(
    complete-ignores-token
    lease-trusts-stepped-clock
    release-without-token
    ack-before-send
    enqueue-outside-transaction
    takeover-while-lease-alive
    one-phase-claim-committed-before-work
    wait-ignores-bound
)
cargo test -p proof --release --no-run --quiet || exit 1

# The model's test under PROOF_MUTATION=$1 (`none`: unmutated): sets
# `out`, `rc` and `took`.
check() {
    local start=$SECONDS
    out=$(PROOF_MUTATION="$1" cargo test -p proof --release --quiet -- --test-threads 1 --nocapture 2>&1)
    rc=$?
    took=$((SECONDS - start))
}

failed=0
for m in "${mutations[@]}"; do
    check "$m"
    if [ "$rc" -ne 0 ] && grep -q '^counterexample for' <<<"$out"; then
        echo "=== mutation $m: CAUGHT ($took s)"
        # Each check's count (or why a mode was left out), then the
        # counterexamples, each with its trace.
        grep -o 'proof: .*' <<<"$out"
        awk '/^counterexample for/{p=1} /^proof:|^thread |^test |^failures:/{p=0} p' <<<"$out"
    else
        echo "=== mutation $m: NOT CAUGHT (exit $rc)"
        tail -20 <<<"$out"
        failed=$((failed + 1))
    fi
done
check none
if [ "$rc" -eq 0 ]; then
    echo "=== unmutated model: passes ($took s)"
    grep -o 'proof: .*' <<<"$out"
else
    echo "=== unmutated model: FAILS"
    tail -40 <<<"$out"
    failed=$((failed + 1))
fi
if [ "$failed" -ne 0 ]; then
    echo "mutations: $failed problem(s)"
    exit 1
fi
echo "mutations: all ${#mutations[@]} caught, unmutated model passes"
