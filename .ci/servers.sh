# Sourced by the steps that start private servers (not a step itself):
# `$dir`, a scratch directory, and `pids`, to which a step adds each server
# it starts in the background; on exit every server is stopped and waited
# for, and the directory removed.
dir=$(mktemp -d)
pids=()
stop() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$dir"
}
trap stop EXIT
