"""``kvwire check``'s isolation: each backend is imported, validated and probed in a child process.

Plugins are trusted code, but a buggy one may exit, loop, crash or print at
import, and ``kvwire check`` must still answer, with valid JSON. The parent
starts ``python -m kvwire.registry.isolation``; before any plugin is imported the child
points its fd 1 at fd 2 (whatever a plugin prints goes to stderr) and answers
on a private duplicate of the original fd 1, in JSON lines. On Linux that child
forks once per backend (kvwire is imported once, so this stays fast), a few at
a time, each with its own time limit; elsewhere the parent starts one child per
backend. A hang becomes status ``timeout``, an exit or a signal
``import-error``, each naming the phase (import, validation, availability()).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from kvwire.registry.loading import (
    BackendInfo,
    Phase,
    dist_of,
    is_module_path,
    load_backend,
    load_module_path,
    module_of,
)
from kvwire.registry.manager import Registry
from kvwire.stdout import take_stdout

__all__ = ["DEFAULT_TIMEOUT", "Job", "check_isolated"]

#: Seconds one backend's import + validation + availability() may take (``kvwire check --timeout``).
DEFAULT_TIMEOUT = 10.0
#: Seconds a child may take to start Python and import kvwire before it reports anything.
STARTUP_S = 60.0
#: Slack on top of the per-backend limit before the parent gives up on a forking child.
GRACE_S = 5.0
#: Backends checked at once by a forking child (forks are cheap; imports are mostly I/O).
PARALLEL = max(8, 2 * (os.cpu_count() or 1))
_MAX_WAIT = 60.0  # longest single select(): a huge --timeout must not overflow it
_EXIT_BUG = 70  # a fork's own failure (not the plugin's), as in sysexits' EX_SOFTWARE
_EXIT_INTERRUPTED = 130  # the plugin raised KeyboardInterrupt (a real Ctrl-C reaches the parent too)

Send = Callable[[Mapping[str, Any]], None]
#: The ``Job.group`` of a ``module.path:ClassName`` backend (imported by path, not from an entry point).
MODULE_PATH_GROUP = "<module path>"


@dataclass(frozen=True)
class Job:
    """One backend to check: its entry point and where it comes from."""

    name: str
    value: str
    group: str  # the entry-point group, or MODULE_PATH_GROUP for a module.path:ClassName backend
    distribution: str | None
    version: str | None

    @property
    def origin(self) -> tuple[str | None, str | None]:
        return self.distribution, self.version


def verdict(job: Job, phase: str | None, *, timeout: float | None = None, code: int | None = None) -> BackendInfo:
    """The report of a child that timed out (``timeout`` set) or ended with exit ``code`` (< 0: signal) unanswered."""
    module = module_of(job.value)
    where = {
        "import": f"while importing {module}",
        "validate": f"while validating {job.value}",
        "availability": f"in {job.value}.availability()",
    }.get(phase or "", "before it imported anything")
    fix = {
        "validate": f"fix the class attributes of {job.value}",
        "availability": f"fix {job.value}.availability() (it must answer without blocking)",
    }.get(phase or "", f"fix the module-level code of {module} (importing it must not block or exit)")
    uninstall = f"or uninstall {job.distribution}" if job.distribution else "or remove it"
    if timeout is not None:
        error = f"no answer within {timeout:g}s {where} (the check process was killed); {fix}, or raise --timeout"
        return BackendInfo(job.name, job.distribution, job.version, job.value, "timeout", error=error)
    if code == _EXIT_INTERRUPTED:
        error = f"raised KeyboardInterrupt {where}; {fix}, {uninstall}"
        return BackendInfo(job.name, job.distribution, job.version, job.value, "import-error", error=error)
    if code is not None and code < 0:
        try:
            signame = f" ({signal.Signals(-code).name})"
        except ValueError:
            signame = ""
        how = f"was killed by signal {-code}{signame}"
    else:
        how = f"exited with code {code} (os._exit, or a crash in native code)"
    error = f"the check process {how} {where}; {fix}, {uninstall}"
    return BackendInfo(job.name, job.distribution, job.version, job.value, "import-error", error=error)


# -- the child ------------------------------------------------------------------


def _sender(fd: int) -> Send:
    def send(message: Mapping[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]

    return send


def _probe(job: Job, send: Send) -> None:
    """Load one backend in this process, reporting each phase before it starts, then the verdict."""

    def phase(step: Phase) -> None:
        send({"name": job.name, "phase": step})

    if job.group == MODULE_PATH_GROUP:
        info = load_module_path(job.name, phase)
    else:
        info = load_backend(job.name, metadata.EntryPoint(job.name, job.value, job.group), *job.origin, phase)
    send({"name": job.name, "info": info.to_dict()})


@dataclass
class _Fork:
    job: Job
    fd: int | None
    deadline: float
    phase: str | None = None
    answered: bool = False
    buffer: bytearray = field(default_factory=bytearray)


def _start_fork(job: Job, timeout: float, channel: int, close: list[int]) -> tuple[int, _Fork]:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the fork: check one backend, then leave without running any of the parent's cleanup
        code = 0
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (read_fd, channel, *close):
                os.close(fd)
            _probe(job, _sender(write_fd))
        except KeyboardInterrupt:  # raised by the plugin's code (loading re-raises it): reported by the parent
            code = _EXIT_INTERRUPTED
        except BaseException:  # a bug of this module: say so on stderr
            traceback.print_exc()
            code = _EXIT_BUG
        finally:
            _exit(code)
    os.close(write_fd)
    return pid, _Fork(job, read_fd, time.monotonic() + timeout)


def _read_lines(fork: _Fork, *, drain: bool) -> list[dict[str, Any]]:
    """Complete JSON lines from the fork's pipe; ``drain`` reads what is left after it exited."""
    assert fork.fd is not None
    if drain:
        os.set_blocking(fork.fd, False)
    while True:
        try:
            data = os.read(fork.fd, 1 << 16)
        except BlockingIOError:
            break
        if not data:
            os.close(fork.fd)
            fork.fd = None
            break
        fork.buffer += data
        if not drain:
            break
    *lines, rest = fork.buffer.split(b"\n")
    fork.buffer = bytearray(rest)
    messages = []
    for line in lines:
        try:
            messages.append(json.loads(line))
        except ValueError:
            continue
    return messages


def _fork_all(jobs: list[Job], timeout: float, send: Send, channel: int) -> None:
    """Check every job in its own fork, at most :data:`PARALLEL` at once, each killed past ``timeout``."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select() through the wakeup fd
    signal.set_wakeup_fd(wake_w)
    queue = list(jobs)
    running: dict[int, _Fork] = {}
    gc.freeze()  # forks then share kvwire's objects instead of copying every page the collector touches

    def handle(fork: _Fork, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            if fork.answered:
                return
            if "phase" in message:
                fork.phase = str(message["phase"])
            if "info" in message:
                fork.answered = True
            send(message)

    def finish(pid: int, fork: _Fork, *, code: int | None = None, timed_out: bool = False) -> None:
        if fork.fd is not None:  # drain first: the last phase the fork reported may still be in the pipe
            handle(fork, _read_lines(fork, drain=True))
            if fork.fd is not None:
                os.close(fork.fd)
        if not fork.answered:
            info = verdict(fork.job, fork.phase, timeout=timeout if timed_out else None, code=code)
            send({"name": fork.job.name, "info": info.to_dict()})
        del running[pid]

    while queue or running:
        while queue and len(running) < PARALLEL:
            close = [wake_r, wake_w, *(f.fd for f in running.values() if f.fd is not None)]
            pid, fork = _start_fork(queue.pop(0), timeout, channel, close)
            running[pid] = fork
        wait = min(max(0.0, min(f.deadline for f in running.values()) - time.monotonic()), _MAX_WAIT)
        fds = [f.fd for f in running.values() if f.fd is not None]
        readable, _, _ = select.select([wake_r, *fds], [], [], wait)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        for fork in list(running.values()):
            if fork.fd is not None and fork.fd in readable:
                handle(fork, _read_lines(fork, drain=False))
        now = time.monotonic()
        for pid, fork in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                finish(pid, fork, code=code)
            elif now >= fork.deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                finish(pid, fork, timed_out=True)
    signal.set_wakeup_fd(-1)
    os.close(wake_r)
    os.close(wake_w)


def main() -> int:
    """The child: read the request on stdin, answer on the original stdout, plugins' output to stderr."""
    channel = take_stdout()
    request = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.path[:] = request["path"]
    logging.getLogger("kvwire").addHandler(logging.NullHandler())  # the parent's report says it all
    jobs = [Job(**job) for job in request["jobs"]]
    send = _sender(channel)
    if request["fork"]:
        _fork_all(jobs, float(request["timeout"]), send, channel)
    else:
        for job in jobs:
            try:
                _probe(job, send)
            except KeyboardInterrupt:  # raised by the plugin's code: the parent reports it for this job
                return _EXIT_INTERRUPTED
    return 0


# -- the parent -----------------------------------------------------------------


class _Child:
    """One ``python -m kvwire.registry.isolation`` process and what it said so far."""

    def __init__(self, jobs: list[Job], timeout: float, fork: bool) -> None:
        self.jobs, self.timeout, self.fork = jobs, timeout, fork
        request = {"timeout": timeout, "fork": fork, "path": sys.path, "jobs": [asdict(j) for j in jobs]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire.registry.isolation"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: one kill reaches whatever a plugin started
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.started = self.last = time.monotonic()
        self.first_phase: float | None = None
        self.phases: dict[str, str] = {}
        self.infos: dict[str, dict[str, Any]] = {}
        self.buffer = b""
        self.done = self.timed_out = False
        try:
            self.proc.stdin.write(json.dumps(request).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it died at start-up; the exit code will say how
            pass

    def deadline(self) -> float:
        if self.first_phase is None:
            return self.started + STARTUP_S + (self.timeout if self.fork else 0.0)
        if self.fork:  # the forking child kills each late fork itself; this only catches the child stuck
            return self.last + self.timeout + GRACE_S
        return self.first_phase + self.timeout

    def feed(self, data: bytes) -> None:
        self.last = time.monotonic()
        *lines, rest = (self.buffer + data).split(b"\n")
        self.buffer = rest
        for line in lines:
            try:
                message = json.loads(line)
                name = str(message["name"])
            except (ValueError, KeyError, TypeError):
                continue
            if "phase" in message:
                self.first_phase = self.first_phase or self.last
                self.phases[name] = str(message["phase"])
            elif "info" in message and name not in self.infos:
                self.infos[name] = message["info"]

    def stop(self, *, timed_out: bool) -> None:
        """Reap the child (killing its whole group when ``timed_out``); sweep anything a plugin left running."""
        self.done, self.timed_out = True, timed_out
        if timed_out:
            self._kill_group()
        try:
            self.proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait()
        self._kill_group()
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def results(self) -> dict[str, BackendInfo]:
        out: dict[str, BackendInfo] = {}
        for job in self.jobs:
            data, phase = self.infos.get(job.name), self.phases.get(job.name)
            if data is not None:
                out[job.name] = BackendInfo.from_dict(data)
            elif self.timed_out:
                out[job.name] = verdict(job, phase, timeout=self.timeout)
            else:
                out[job.name] = verdict(job, phase, code=self.proc.returncode)
        return out


def _run(jobs: list[Job], timeout: float, fork: bool) -> dict[str, BackendInfo]:
    children = [_Child(jobs, timeout, True)] if fork else [_Child([job], timeout, False) for job in jobs]
    try:
        while live := [c for c in children if not c.done]:
            now = time.monotonic()
            for child in live:
                if now >= child.deadline():
                    child.stop(timed_out=True)
            live = [c for c in live if not c.done]
            if not live:
                break
            wait = min(max(0.0, min(c.deadline() for c in live) - now), _MAX_WAIT)
            readable, _, _ = select.select([c.fd for c in live], [], [], wait)
            for child in live:
                if child.fd in readable:
                    data = os.read(child.fd, 1 << 16)
                    if data:
                        child.feed(data)
                    else:
                        child.stop(timed_out=False)
    finally:
        for child in children:
            if not child.done:
                child.stop(timed_out=True)
    results: dict[str, BackendInfo] = {}
    for child in children:
        results.update(child.results())
    return results


def check_isolated(
    registry: Registry, timeout: float = DEFAULT_TIMEOUT, *, fork: bool | None = None
) -> list[BackendInfo]:
    """:meth:`Registry.scan`, but every allowed backend is loaded in a child process with a time limit.

    Blocked and duplicate backends are reported from metadata. ``fork``: one
    forking child (default on Linux) or one child per backend. Without POSIX
    process groups (Windows) this falls back to the in-process scan.
    """
    if os.name != "posix":
        return registry.scan()
    entries = registry.entries()
    jobs = [
        Job(name, entry.value, entry.group, *dist_of(entry))
        for name, entry in entries.items()
        if isinstance(entry, metadata.EntryPoint)
    ]
    paths = sorted(n for n in registry.allow or () if is_module_path(n))  # module paths: only when allow-listed
    jobs += [Job(name, name, MODULE_PATH_GROUP, None, None) for name in paths]
    use_fork = sys.platform.startswith("linux") if fork is None else fork
    results = _run(jobs, timeout, use_fork) if jobs else {}
    found = [results[name] if isinstance(entry, metadata.EntryPoint) else entry for name, entry in entries.items()]
    return found + [results[name] for name in paths]


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown (a plugin's atexit hooks included): the answer is out."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a plugin may have closed it; nothing left to tell
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
