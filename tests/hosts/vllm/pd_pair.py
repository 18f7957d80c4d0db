"""The parent's end of :mod:`pd_node`: start a vLLM prefill or decode node in ``.venv-vllm`` and talk to it.

Used by ``tests/hosts/test_vllm_connector.py`` and ``bench/vllm_connector.py``. The channel is
:class:`kvwire.control.Channel` (bounded JSON lines with a deadline on every read), the child's stderr
(vLLM's logs) goes to a file whose tail :meth:`NodeProcess.stderr_tail` returns for failure messages.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvwire.control import Channel, ControlError

__all__ = ["PD_NODE", "ROOT", "NodeProcess", "node_env"]

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
PD_NODE = HERE / "pd_node.py"


def node_env() -> dict[str, str]:
    """The environment of a node: vLLM on CPU, offline, UCX without EFA, the venv's own packages only."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.update({"UCX_MODULES": "^efa", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_LOGGING_LEVEL": "WARNING"})
    env.pop("PYTHONPATH", None)
    env.pop("KVWIRE_VLLM_UNSUPPORTED", None)  # a release's support is what the node shows, never assumed
    return env


class NodeProcess(Channel):
    """A ``pd_node.py`` child of ``python`` (the vLLM venv's interpreter)."""

    def __init__(self, python: Path, what: str, timeout_s: float = 180.0, env: dict[str, str] | None = None) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="kvwire-vllm-node-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), str(PD_NODE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
            cwd=ROOT,
            env=env or node_env(),
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        super().__init__(self.proc.stdout.fileno(), self.proc.stdin.fileno(), what=what, timeout_s=timeout_s)

    def call(self, cmd: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply; the node's stderr tail is added to any failure."""
        try:
            return self.request({"cmd": cmd, **fields}, timeout_s)
        except ControlError as exc:
            raise ControlError(f"{exc}\n--- {self.what} stderr ---\n{self.stderr_tail()}") from None

    def stderr_tail(self, chars: int = 4000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the node and reap it (a prefill that dies)."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        """Ask the node to quit, kill it if it does not within 20 s, and remove its log."""
        if self.proc.poll() is None:
            with contextlib.suppress(ControlError, OSError):
                self.request({"cmd": "quit"}, timeout_s=20)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)
