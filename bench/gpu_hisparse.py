"""GPU check for kvwire-hisparse: decode-side device buffers in CUDA memory, every byte verified.

For a machine with an NVIDIA GPU (issue 6). It needs Mooncake's CUDA build instead
of the CPU one, and torch with CUDA:

    .venv/bin/pip uninstall -y mooncake-transfer-engine-non-cuda
    .venv/bin/pip install 'kvwire-mooncake[cuda13]' torch      # or [cuda] for CUDA 12
    .venv/bin/python bench/gpu_hisparse.py

It runs ``kvwire bench --backend hisparse --preset deepseek-v3-hisparse --device cuda``
(host buffers in DRAM, device buffers on the GPU, split page ids), then the same
with every decode buffer on the GPU through ``mooncake``, and prints one JSON
object per run. Exit status 0 only if both runs verified every byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

RUNS = [
    ["--backend", "hisparse", "--preset", "deepseek-v3-hisparse"],
    ["--backend", "mooncake", "--preset", "llama3-8b"],
]


def main() -> int:
    ok = True
    for extra in RUNS:
        cmd = [
            sys.executable,
            "-m",
            "kvwire",
            "bench",
            *extra,
            "--device",
            "cuda",
            "--requests",
            "8",
            "--tokens",
            "4096",
            "--json",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(json.dumps({"cmd": cmd[3:], "error": proc.stderr[-2000:]}))
            ok = False
            continue
        result = json.loads(proc.stdout)
        print(json.dumps({"cmd": cmd[3:], **result}))
        ok = ok and bool(result["verified"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
