#!/usr/bin/env bash
# Build the CPU-only venv in which sglang 0.5.23's own disaggregation code imports
# (sglang.srt.disaggregation.mooncake.conn and friends), for kvwire's sglang integration tests.
#
#   tests/hosts/sglang/make_venv.sh [VENV]        (default: .venv-sglang, relative to the cwd)
#
# Everything is installed --no-deps: sglang's declared dependencies pull a CUDA torch of several GB.
# Order: pip/setuptools bootstrap, sglang==0.5.23, the local CPU torch wheel, requirements.txt, the
# torchvision stub, the Mooncake engine, kvwire core, plugins/mooncake, plugins/hisparse and hosts/sglang
# (editable; kvwire-hisparse so that the prefill serves HiSparse split destinations, as a deployment would).
#
# Idempotent: VENV/.kvwire-sglang-stamp holds a sha256 over requirements.txt, this script and the
# stub's sources (plus the pins below); when it matches, nothing is done (and no network is needed).
# Otherwise VENV is deleted and rebuilt from scratch; the stamp is written last, after an import check.
#
# Exit codes: 0 ready; 3 package index unreachable (one line on stderr:
# "sglang venv: package index unreachable (...)", so tests can skip with it); 4 a local prerequisite is
# missing (python3.11, the torch wheel); anything else: a real failure.
#
# Overrides (environment): PYTHON (python3.11), TORCH_WHEEL, MOONCAKE_ENGINE, PIP_INDEX_URL.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
VENV="${1:-.venv-sglang}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
VENV="${VENV%/}"

PYTHON="${PYTHON:-python3.11}"
SGLANG="sglang==0.5.23"
TORCH_WHEEL="${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
# Same distribution and version as in the repo's .venv (the CPU build of the Mooncake Transfer Engine).
MOONCAKE_ENGINE="${MOONCAKE_ENGINE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
BOOTSTRAP=(pip==26.3 setuptools==84.2.1)  # setuptools>=77 builds kvwire's pyproject without isolation
REQUIREMENTS="$HERE/requirements.txt"
STUB="$HERE/torchvision_stub"
STAMP="$VENV/.kvwire-sglang-stamp"
INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}"

say() { printf 'sglang venv: %s\n' "$*" >&2; }
die() { local code="$1"; shift; say "$*"; exit "$code"; }

stamp_hash() {
    {
        printf '%s\n' "$SGLANG" "$TORCH_WHEEL" "$MOONCAKE_ENGINE" "${BOOTSTRAP[@]}"
        cat "$REQUIREMENTS" "${BASH_SOURCE[0]}"
        (cd "$STUB" && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' | LC_ALL=C sort | xargs cat)
    } | sha256sum | cut -d' ' -f1
}

# Prints nothing and returns 0 when the index answers; else prints the reason and returns 1.
probe_index() {
    "$PYTHON" - "$INDEX_URL" <<'PY'
import os, ssl, sys, urllib.request
url = sys.argv[1].rstrip("/") + "/sglang/"
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

command -v "$PYTHON" >/dev/null || die 4 "$PYTHON not found (the torch wheel is cp311)"
[ -f "$TORCH_WHEEL" ] || die 4 "torch CPU wheel not found ($TORCH_WHEEL)"

# One builder per venv path at a time (parallel test sessions).
LOCK="${TMPDIR:-/tmp}/kvwire-sglang-venv-$(printf '%s' "$VENV" | sha256sum | cut -c1-16).lock"
exec 9>"$LOCK"
flock 9

WANT="$(stamp_hash)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
    say "up to date ($VENV)"
    exit 0
fi

if ! why="$(probe_index)"; then die 3 "package index unreachable ($why)"; fi

START=$SECONDS
say "building $VENV from scratch"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1

pip_install "${BOOTSTRAP[@]}"
pip_install "$SGLANG"
pip_install "$TORCH_WHEEL"
pip_install -r "$REQUIREMENTS"
# Build the stub from a copy so no build/ or *.egg-info lands in the source tree.
STUB_COPY="$(mktemp -d)"
trap 'rm -rf "$STUB_COPY"' EXIT
cp -r "$STUB/." "$STUB_COPY/"
rm -rf "$STUB_COPY/build" "$STUB_COPY"/*.egg-info
pip_install --no-build-isolation "$STUB_COPY"
pip_install "$MOONCAKE_ENGINE"
if [ -x "$REPO/.venv/bin/python" ]; then  # the repo's own venv is the reference for the engine version
    have="$("$REPO/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))' 2>/dev/null || true)"
    [ -z "$have" ] || [ "$have" = "${MOONCAKE_ENGINE##*==}" ] \
        || say "warning: $REPO/.venv has mooncake-transfer-engine-non-cuda $have, this venv ${MOONCAKE_ENGINE##*==}"
fi
pip_install --no-build-isolation -e "$REPO/core" -e "$REPO/plugins/mooncake" -e "$REPO/plugins/hisparse" \
    -e "$REPO/hosts/sglang"

# Fail here, not in the tests, if the chain no longer imports.
"$VENV/bin/python" -W ignore -c "import sglang.srt.disaggregation.mooncake.conn, kvwire, kvwire_mooncake, kvwire_hisparse" \
    || die 1 "import check failed in $VENV"

printf '%s\n' "$WANT" >"$STAMP"
say "ready ($VENV, $(("$VENV/bin/python" -m pip list 2>/dev/null || true) | tail -n +3 | wc -l) packages, $((SECONDS - START))s)"
