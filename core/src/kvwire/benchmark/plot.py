"""``kvwire bench --plot FILE.png``: per-request throughput and latency of every mode the run compared.

An optional extra: matplotlib is imported only here, only when ``--plot`` is
given (``pip install 'kvwire[plot]'``, or ``pip install matplotlib``). The
bench checks :func:`check_plot` before it starts, so a missing matplotlib or
an unwritable path fails in a second, not after the run.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from kvwire.errors import ConfigError

__all__ = ["FORMATS", "Series", "check_plot", "write_plot"]

#: A mode's per-request (bytes, seconds), in request order.
Series = dict[str, list[tuple[int, float]]]
#: The file formats --plot writes (by the file's suffix).
FORMATS = (".png", ".svg", ".pdf")

_MISSING = "--plot needs matplotlib, an optional extra: pip install 'kvwire[plot]' (or pip install matplotlib)"


def check_plot(path: str) -> None:
    """ConfigError naming --plot: matplotlib missing, an unknown suffix, a dangling symbolic link, a folder
    where the file should be, or a folder that does not exist."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ConfigError(f"--plot {path!r}: the file must end in {', '.join(FORMATS)}")
    if os.path.islink(path) and not os.path.exists(path):  # savefig would follow it, after the whole run
        raise ConfigError(f"--plot {path!r}: a symbolic link to {os.readlink(path)!r}, which does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"--plot {path!r} is a folder; name the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path!r}: the folder {folder!r} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(_MISSING)


def write_plot(path: str, series: Series, title: str) -> None:
    """Draw throughput (GB/s) and latency (ms) per request, one line per mode, into ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ConfigError(f"{_MISSING} ({exc})") from None
    figure = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(figure)  # no pyplot: no global state, no display needed
    rate, latency = figure.subplots(2, 1, sharex=True)
    for mode, points in series.items():
        requests = list(range(1, len(points) + 1))
        style: dict[str, Any] = {"marker": "o", "markersize": 3, "linewidth": 1, "label": mode}
        rate.plot(requests, [b / s / 1e9 if s > 0 else 0.0 for b, s in points], **style)
        latency.plot(requests, [s * 1e3 for _, s in points], **style)
    rate.set_ylabel("throughput (GB/s)")
    rate.set_ylim(bottom=0)
    latency.set_ylabel("latency (ms)")
    latency.set_ylim(bottom=0)
    latency.set_xlabel("request")
    latency.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (rate, latency):
        axes.grid(True, alpha=0.3)
        axes.legend(loc="best", fontsize="small")
    figure.suptitle(title, fontsize="medium")
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--plot {path!r} could not be written: {exc.strerror or exc}") from None
