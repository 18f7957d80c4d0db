#!/usr/bin/env bash
# Build the CPU-only venv in which vLLM 0.33.0's KV-connector machinery imports and runs without a GPU or a
# model (KVConnectorFactory, KVConnectorBase_V1, the v1 Scheduler, the KV-cache planner and allocator, the
# CPU attention backend, vLLM's own NixlConnector), for kvwire's vLLM integration tests (tests/hosts/vllm).
#
#   tests/hosts/vllm/make_venv.sh [VENV]        (default: .venv-vllm, relative to the cwd)
#
# Everything is installed --no-deps: vllm's declared dependencies pull a CUDA torch of several GB.
# Order: pip/setuptools bootstrap, vllm==0.33.0, the local CPU torch wheel, requirements.txt, nixl (the meta
# package) + nixl-cu12, the Mooncake engine, kvwire core, plugins/mooncake and plugins/nixl (editable).
# Use the venv with VLLM_TARGET_DEVICE=cpu (vLLM's CpuPlatform); see README.md next to this script.
#
# Idempotent: VENV/.kvwire-vllm-stamp holds a sha256 over requirements.txt, this script and the pins below;
# when it matches, nothing is done (and no network is needed). Otherwise VENV is deleted and rebuilt from
# scratch; the stamp is written last, after an import check.
#
# Exit codes: 0 ready; 3 package index unreachable (one line on stderr:
# "vllm venv: package index unreachable (...)", so tests can skip with it); 4 a local prerequisite is
# missing (python3.11, the torch wheel); anything else: a real failure.
#
# Overrides (environment): PYTHON (python3.11), TORCH_WHEEL, MOONCAKE_ENGINE, PIP_INDEX_URL, VLLM_VERSION
# (0.33.0; 0.32.0, the previous minor release, declares the same torch and a transformers range that holds
# requirements.txt's: tests/hosts/conftest.py builds .venv-vllm-0.32.0 with it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
VENV="${1:-.venv-vllm}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
VENV="${VENV%/}"

PYTHON="${PYTHON:-python3.11}"
VLLM="vllm==${VLLM_VERSION:-0.33.0}"
TORCH_WHEEL="${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
# vLLM's NixlConnector imports nixl._api: the `nixl` meta package re-exports the wheel of one CUDA major
# (nixl-cu12, as in the repo's .venv; it runs on CPU with the UCX backend). Both --no-deps.
NIXL=(nixl==1.5.1 nixl-cu12==1.5.1)
# Same distribution and version as in the repo's .venv (the CPU build of the Mooncake Transfer Engine).
MOONCAKE_ENGINE="${MOONCAKE_ENGINE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
BOOTSTRAP=(pip==26.3 setuptools==84.2.1)  # setuptools>=77 builds kvwire's pyproject without isolation
REQUIREMENTS="$HERE/requirements.txt"
STAMP="$VENV/.kvwire-vllm-stamp"
INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}"

LABEL="vllm venv"
PROBE="vllm"
REPO_HOSTS="$(cd "$HERE/.." && pwd)"
stamp_inputs() {
    printf '%s\n' "$VLLM" "$TORCH_WHEEL" "${NIXL[@]}" "$MOONCAKE_ENGINE" "${BOOTSTRAP[@]}"
    cat "$REQUIREMENTS"
}
# shellcheck source=../venv_common.sh
source "$REPO_HOSTS/venv_common.sh"
if venv_up_to_date; then exit 0; fi
start_build

pip_install "${BOOTSTRAP[@]}"
pip_install "$VLLM"  # a 326-336 MB wheel (the CUDA build; its Python side is what runs here)
pip_install "$TORCH_WHEEL"
pip_install -r "$REQUIREMENTS"
pip_install "${NIXL[@]}"
pip_install "$MOONCAKE_ENGINE"
for pin in "$MOONCAKE_ENGINE" "${NIXL[1]}"; do check_pin_against_repo "$pin"; done
pip_install --no-build-isolation -e "$REPO/core" -e "$REPO/plugins/mooncake" -e "$REPO/plugins/nixl"

# Fail here, not in the tests, if the chain no longer imports.
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$HERE" "$VENV/bin/python" -W ignore -c "
import vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.worker.utils, releases
import vllm.v1.attention.backends.cpu_attn, vllm.distributed.kv_transfer.kv_connector.v1.nixl
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.platforms import current_platform
assert type(current_platform).__name__ == 'CpuPlatform', current_platform
import nixl._api, mooncake.engine, kvwire, kvwire_mooncake, kvwire_nixl
" 2>/dev/null || die 1 "import check failed in $VENV (run the import above in it to see why)"

write_stamp
