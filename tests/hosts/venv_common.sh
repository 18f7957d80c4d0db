# Shared by tests/hosts/<host>/make_venv.sh: the steps every host venv build takes, written once.
# Sourced (not run) after the script sets:
#   LABEL     how messages start ("sglang venv")
#   PROBE     a package whose index page answers when the package index is reachable ("sglang")
#   VENV      the venv's absolute path;  PYTHON, TORCH_WHEEL, INDEX_URL  as the script's header says
#   STAMP     the stamp file;  stamp_inputs()  a function printing what the stamp hashes besides the scripts
# It provides: say, die, pip_install, check_pin_against_repo, venv_up_to_date (the prerequisites, the per-venv
# lock, the stamp compared), start_build (the index probed, an empty venv) and write_stamp (after the import check).

say() { printf '%s: %s\n' "$LABEL" "$*" >&2; }
die() { local code="$1"; shift; say "$*"; exit "$code"; }

COMMON_SH="${BASH_SOURCE[0]}"

stamp_hash() {
    { stamp_inputs; cat "$COMMON_SH" "$0"; } | sha256sum | cut -d' ' -f1
}

# Prints nothing and returns 0 when the index answers; else prints the reason and returns 1.
probe_index() {
    "$PYTHON" - "$INDEX_URL" "$PROBE" <<'PY'
import os, ssl, sys, urllib.request
url = sys.argv[1].rstrip("/") + "/" + sys.argv[2] + "/"
ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15, context=ctx) as r:
        if r.status >= 400:
            raise OSError(f"HTTP {r.status}")
except Exception as e:  # noqa: BLE001 - any failure means "unreachable" here
    print(f"{url}: {type(e).__name__}: {e}".replace("\n", " "))
    sys.exit(1)
PY
}

# pip, in the venv, never resolving dependencies. A failure with the index gone becomes exit 3.
# (Drops pip's warning about file:// extra indexes that lack a package: noise from this machine's pip.conf.)
pip_install() {
    if ! "$VENV/bin/python" -m pip install --no-deps --no-input --progress-bar off -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; } >&2; then
        local why
        if ! why="$(probe_index)"; then die 3 "package index unreachable ($why)"; fi
        die 1 "pip install --no-deps $* failed"
    fi
}

# 0 when the venv is up to date (nothing to do), after checking the prerequisites and taking the per-venv lock
# (held until the script exits). Called as the condition of an `if`, so it only compares.
venv_up_to_date() {
    command -v "$PYTHON" >/dev/null || die 4 "$PYTHON not found (the torch wheel is cp311)"
    [ -f "$TORCH_WHEEL" ] || die 4 "torch CPU wheel not found ($TORCH_WHEEL)"
    # One builder per venv path at a time (parallel test sessions).
    local lock
    lock="${TMPDIR:-/tmp}/kvwire-$PROBE-venv-$(printf '%s' "$VENV" | sha256sum | cut -c1-16).lock"
    exec 9>"$lock"
    flock 9 || die 1 "cannot lock $lock"
    WANT="$(stamp_hash)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
        say "up to date ($VENV)"
        return 0
    fi
    return 1
}

# The index answers (else exit 3) and VENV is a fresh, empty venv.
start_build() {
    local why
    if ! why="$(probe_index)"; then die 3 "package index unreachable ($why)"; fi
    START=$SECONDS
    say "building $VENV from scratch"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
}

# The repo's own .venv is the reference for an engine's version: warn when this venv pins another.
check_pin_against_repo() {
    local pin="$1" have
    [ -x "$REPO/.venv/bin/python" ] || return 0
    have="$("$REPO/.venv/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' \
        "${pin%%==*}" 2>/dev/null || true)"
    [ -z "$have" ] || [ "$have" = "${pin##*==}" ] || say "warning: $REPO/.venv has ${pin%%==*} $have, this venv ${pin##*==}"
}

write_stamp() {
    printf '%s\n' "$WANT" >"$STAMP"
    say "ready ($VENV, $(("$VENV/bin/python" -m pip list 2>/dev/null || true) | tail -n +3 | wc -l) packages, $((SECONDS - START))s)"
}
