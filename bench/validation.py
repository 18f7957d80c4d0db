"""Cost of start-up validation: ``kvwire check`` wall time, and validation per backend.

Validation time excludes the backend's import: each installed backend class is
imported first, then ``validate_backend`` is timed alone (median of repeats),
side by side with a pluggy ``register`` of an instance (what loading costs
without kvwire's checks).

    python bench/validation.py [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from importlib import metadata

import pluggy

import kvwire
from kvwire.registry.findings import BackendOrigin
from kvwire.spec.pluggy_project import ENTRY_POINT_GROUP, PROJECT_NAME


def _median_us(fn: object, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    walls = []
    for _ in range(5):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvwire", "check"], capture_output=True, check=False)
        walls.append(time.perf_counter() - start)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - start

    rows = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:
            rows.append({"backend": ep.name, "error": repr(exc)})
            continue
        origin = BackendOrigin(
            ep.name, ep.dist.name if ep.dist else None, ep.dist.version if ep.dist else None, ep.value
        )
        kvwire.validate_backend(cls, origin)  # warm caches of the spec itself
        validate_us = _median_us(lambda cls=cls, origin=origin: kvwire.validate_backend(cls, origin), args.repeat)

        def pluggy_register(cls: type = cls) -> None:
            pm = pluggy.PluginManager(PROJECT_NAME)
            pm.add_hookspecs(kvwire.BackendSpec)
            pm.register(object.__new__(cls))

        register_us = _median_us(pluggy_register, args.repeat)
        rows.append(
            {
                "backend": ep.name,
                "validate_us": round(validate_us, 1),
                "pluggy_register_us": round(register_us, 1),
                "ratio": round(validate_us / register_us, 2),
            }
        )

    result = {
        "check_wall_s_median": round(statistics.median(walls), 3),
        "python_startup_s": round(bare, 3),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"kvwire check wall time: {result['check_wall_s_median']} s (median of 5; bare python start {bare:.3f} s)")
    print(f"{'backend':<12} {'validate_us':>12} {'pluggy_register_us':>19} {'ratio':>6}")
    for row in rows:
        if "error" in row:
            print(f"{row['backend']:<12} import error: {row['error']}")
        else:
            print(f"{row['backend']:<12} {row['validate_us']:>12} {row['pluggy_register_us']:>19} {row['ratio']:>6}")


if __name__ == "__main__":
    main()
