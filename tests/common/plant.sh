# Sourced by the mutation scripts (tests/simulation/, tests/real_stores/):
# a scratch copy of the repository and `plant FILE OLD NEW`, which replaces
# the one occurrence of OLD in the copy's FILE. The caller sets `repo`.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# A fresh copy of the repository in $scratch/p (not -a: fresh mtimes, so
# that cargo rebuilds a file the last mutation changed and this copy
# restores).
fresh_copy() {
    rm -rf "$scratch/p"
    rsync -rlp --exclude target --exclude .git "$repo/" "$scratch/p/"
}

# file, the text replaced, its replacement
plant() {
    python3 - "$scratch/p/$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"{path}: the text to replace occurs {text.count(old)} times"
open(path, "w").write(text.replace(old, new))
PY
}
