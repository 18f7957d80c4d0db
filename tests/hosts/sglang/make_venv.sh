#!/usr/bin/env bash
# Build the CPU-only venv in which sglang 0.5.23's own disaggregation code imports
# (sglang.srt.disaggregation.mooncake.conn and friends), for kvwire's sglang integration tests.
#
#   tests/hosts/sglang/make_venv.sh [VENV]        (default: .venv-sglang, relative to the cwd)
#
# Everything is installed --no-deps: sglang's declared dependencies pull a CUDA torch of several GB.
# Order: pip/setuptools bootstrap, sglang==0.5.23, the local CPU torch wheel, requirements.txt, the
# torchvision and sgl_kernel stubs, the Mooncake engine, kvwire core, plugins/mooncake, plugins/hisparse and hosts/sglang
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
# NIXL's engine, for sglang serving through kvwire-nixl (KVWIRE_SGLANG_BACKEND=nixl); without its deps, as the
# repository's .venv installs it: its unpinned torch would pull a CUDA build over sglang's CPU torch.
NIXL_ENGINE="${NIXL_ENGINE:-nixl-cu12==1.5.1}"
BOOTSTRAP=(pip==26.3 setuptools==84.2.1)  # setuptools>=77 builds kvwire's pyproject without isolation
REQUIREMENTS="$HERE/requirements.txt"
STUB="$HERE/torchvision_stub"
KERNEL_STUB="$HERE/sgl_kernel_stub"
STAMP="$VENV/.kvwire-sglang-stamp"
INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}"

LABEL="sglang venv"
PROBE="sglang"
REPO_HOSTS="$(cd "$HERE/.." && pwd)"
stamp_inputs() {
    printf '%s\n' "$SGLANG" "$TORCH_WHEEL" "$MOONCAKE_ENGINE" "$NIXL_ENGINE" "${BOOTSTRAP[@]}"
    cat "$REQUIREMENTS"
    for stub in "$STUB" "$KERNEL_STUB"; do
        (cd "$stub" && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' | LC_ALL=C sort | xargs cat)
    done
}
# shellcheck source=../venv_common.sh
source "$REPO_HOSTS/venv_common.sh"
if venv_up_to_date; then exit 0; fi
start_build

pip_install "${BOOTSTRAP[@]}"
pip_install "$SGLANG"
pip_install "$TORCH_WHEEL"
pip_install -r "$REQUIREMENTS"
# Build each stub from a copy so no build/ or *.egg-info lands in the source tree.
STUB_COPIES="$(mktemp -d)"
trap 'rm -rf "$STUB_COPIES"' EXIT
for stub in "$STUB" "$KERNEL_STUB"; do
    copy="$STUB_COPIES/$(basename "$stub")"
    cp -r "$stub/." "$copy/"
    rm -rf "$copy/build" "$copy"/*.egg-info
    pip_install --no-build-isolation "$copy"
done
pip_install "$MOONCAKE_ENGINE"
check_pin_against_repo "$MOONCAKE_ENGINE"
pip_install --no-deps "$NIXL_ENGINE"
check_pin_against_repo "$NIXL_ENGINE"
pip_install --no-build-isolation -e "$REPO/core" -e "$REPO/plugins/mooncake" -e "$REPO/plugins/hisparse" \
    -e "$REPO/plugins/nixl" -e "$REPO/hosts/sglang"

# Fail here, not in the tests, if the chain no longer imports.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "import sglang.srt.disaggregation.mooncake.conn, kvwire, \
kvwire_mooncake, kvwire_hisparse, kvwire_nixl, nixl_cu12, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, \
sglang.srt.managers.tokenizer_manager, sglang.srt.managers.detokenizer_manager, sglang_router.launch_router" \
    || die 1 "import check failed in $VENV"

write_stamp
