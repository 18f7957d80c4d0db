"""One side (prefill or decode) of a KV transfer run by sglang 0.5.23's own disaggregation code on CPU.

Run by :mod:`pair` with the sglang venv's python, never imported by the repo's tests::

    python side.py --role prefill|decode --scenario plain-mha --mode stock|kvwire \\
        --bootstrap-port P --room R --workdir DIR --timeout-s 90

What is sglang's here and what is not: ``ServerArgs``, the published runtime context,
the shared Mooncake engine (``maybe_init_shared_mooncake_transfer_engine``, over TCP),
``MooncakeKVBootstrapServer``, the manager class ``get_kv_class`` returns (which
registers the pools with the engine and, on the prefill, starts the
``transfer_worker`` threads that call ``send_kvcache``), ``MooncakeKVSender`` and
``MooncakeKVReceiver``, all sglang's. Ours: the KV pools (CPU fp16 tensors of random
bytes standing in for a model's pools), ``KVArgs`` filled the way sglang's
``PrefillBootstrapQueue`` / ``DecodePreallocQueue._init_kv_manager`` fill it for that
pool shape, and one stand-in, a one-rank ``pp_group`` (there is no torch.distributed).

In ``kvwire`` mode the process calls ``sglang.srt.plugins.load_plugins()`` first, as
sglang's scheduler does, and ``SGLANG_PLUGINS=kvwire`` selects kvwire-sglang's plugin.

Coordination with the other side goes through files in ``--workdir``: the prefill
writes ``prefill.ready`` once its bootstrap server, manager and sender exist; the
decode writes ``decode.done`` after verifying, so the prefill keeps its bootstrap
server up until then. Each side writes its result to ``<role>.json`` (and prints it
as one JSON line) and exits with ``os._exit`` (sglang's daemon threads and the
Mooncake engine never join); a side whose peer's result appeared gives up waiting.

Each decode KV buffer is followed by guard pages outside what sglang registers
(``kv_data_lens`` stops before them), so a write past the pool is seen, not lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROLES = ("prefill", "decode")
MODES = ("stock", "kvwire")

#: Tokens per page (sglang's ``--page-size``), the same on both sides as sglang requires.
PAGE_SIZE = 4
#: MHA pool: KV heads and head dim (fp16), so a K or V page is 4 * 2 * 8 * 2 = 128 bytes.
HEAD_NUM, HEAD_DIM = 2, 8
#: MLA pool: kv_lora_rank + qk_rope_head_dim, so a page is 4 * 24 * 2 = 192 bytes.
MLA_DIM = 16 + 8
#: Pages per KV buffer: the pools differ in size, so a positional mix-up cannot go unseen.
PREFILL_PAGES, DECODE_PAGES = 10, 12
#: Unregistered pages after each KV buffer (on both sides), to catch writes past the pool.
GUARD_PAGES = 2
#: sglang's metadata buffers, stood in by two small byte buffers, slot ``AUX_INDEX`` used.
AUX_BUFFERS, AUX_SLOTS, AUX_ITEM_BYTES, AUX_INDEX = 2, 4, 64, 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A pool shape and the pages one request moves.

    ``layer_ids`` is None for a plain pool (sglang's ``build_kv_layer_ids`` gives
    ``[]``); for a hybrid (``HybridLinearKVPool``) pool it is the full-attention
    layers' global ids, and ``kv_layer_ids`` is ``layer_ids * 2`` (MHA) or
    ``layer_ids`` (MLA), as sglang's ``get_kv_layer_ids`` returns them.
    """

    name: str
    mla: bool
    num_layers: int
    layer_ids: tuple[int, ...] | None
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    expect_success: bool = True

    @property
    def hybrid(self) -> bool:
        return self.layer_ids is not None

    @property
    def num_buffers(self) -> int:
        """sglang's KV buffer count: K of every layer then V of every layer (MHA), one per layer (MLA)."""
        return self.num_layers if self.mla else 2 * self.num_layers

    @property
    def page_bytes(self) -> int:
        return PAGE_SIZE * (MLA_DIM if self.mla else HEAD_NUM * HEAD_DIM) * 2

    def kv_layer_ids(self) -> list[int]:
        """``KVArgs.kv_layer_ids`` as sglang's ``build_kv_layer_ids`` builds it for this pool."""
        if self.layer_ids is None:
            return []
        ids = list(self.layer_ids)
        return ids if self.mla else ids * 2


#: Source and destination pages: out of order, not contiguous, a run of two (7, 8 -> 3, 4).
_SRC, _DST = (2, 7, 8, 0), (9, 3, 4, 11)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("plain-mha", mla=False, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST),
        Scenario("plain-mla", mla=True, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST),
        Scenario("hybrid-mha", mla=False, num_layers=2, layer_ids=(3, 5), src_pages=_SRC, dst_pages=_DST),
        Scenario("hybrid-mla", mla=True, num_layers=2, layer_ids=(3, 5), src_pages=_SRC, dst_pages=_DST),
        # The decode asks for page DECODE_PAGES: the first guard page, one past its pool.
        Scenario(
            "bad-page",
            mla=False,
            num_layers=2,
            layer_ids=None,
            src_pages=(1, 2, 5),
            dst_pages=(0, 6, DECODE_PAGES),
            expect_success=False,
        ),
    )
}


# -- pools -------------------------------------------------------------------------------------


def random_bytes(seed: int, shape: tuple[int, ...]) -> Any:
    """A CPU fp16 tensor of ``shape`` whose bytes are random and never zero (seeded, so both sides can rebuild it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    return torch.randint(1, 256, (n * 2,), dtype=torch.uint8, generator=g).view(torch.float16).reshape(shape)


def kv_buffers(scenario: Scenario, role: str) -> list[Any]:
    """The KV buffers of ``role``'s pool (each with :data:`GUARD_PAGES` trailing guard pages), in sglang's order."""
    pages = (PREFILL_PAGES if role == "prefill" else DECODE_PAGES) + GUARD_PAGES
    shape = (pages, PAGE_SIZE, 1, MLA_DIM) if scenario.mla else (pages, PAGE_SIZE, HEAD_NUM, HEAD_DIM)
    base = 1000 if role == "prefill" else 2000
    return [random_bytes(base + i, shape) for i in range(scenario.num_buffers)]


def aux_buffers(role: str) -> list[Any]:
    """Stand-ins for sglang's ``MetadataBuffers``: sglang sends them on its own path; they are not verified."""
    base = 3000 if role == "prefill" else 4000
    return [random_bytes(base + i, (AUX_SLOTS, AUX_ITEM_BYTES // 2)) for i in range(AUX_BUFFERS)]


def page_bytes_view(t: Any) -> Any:
    """``t`` as [page, bytes] (uint8), for byte-exact comparisons."""
    import torch

    return t.view(t.shape[0], -1).view(dtype=torch.uint8)


# -- sglang setup ------------------------------------------------------------------------------


class OnePpRankGroup:
    """Stand-in for sglang's ``pp_group`` (a ``GroupCoordinator`` over torch.distributed) with pp_size 1.

    ``CommonKVManager.__init__`` reads ``get_parallel().pp_group`` and keeps it; with
    one pipeline stage it is never used for communication. Without torch.distributed
    the read fails ("parallel name 'pp_group' has not been written in this process").
    """

    rank_in_group = 0
    world_size = 1
    is_first_rank = True
    is_last_rank = True
    ranks = (0,)


def is_mla_backend(scenario: Scenario) -> bool:
    """sglang's ``is_mla_backend(token_to_kv_pool)``: True for an MLA pool, False for a hybrid (linear) pool."""
    return scenario.mla and not scenario.hybrid


def publish_server_args(role: str, bootstrap_port: int) -> Any:
    """sglang's ``ServerArgs`` for this role, published as a scheduler process's runtime context."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy",
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        host="127.0.0.1",
        disaggregation_bootstrap_port=bootstrap_port,
        device="cpu",
        page_size=PAGE_SIZE,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    get_parallel().override_permanently(pp_group=OnePpRankGroup())
    # sglang's own choice of engine: mooncake PD -> init_mooncake_transfer_engine(get_local_ip_auto(), ...)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    return sa


def build_kv_args(scenario: Scenario, role: str, sa: Any, kv: list[Any], aux: list[Any]) -> Any:
    """``KVArgs`` as sglang's ``_init_kv_manager`` fills it (prefill.py / decode.py), for one TP rank, no PP."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    pool_pages = PREFILL_PAGES if role == "prefill" else DECODE_PAGES
    a = get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS)()
    a.engine_rank = 0
    a.pp_rank = 0
    a.system_dp_rank = None  # get_parallel().dp_rank: no data-parallel controller
    a.rust_http_port = None
    a.kv_cache_dtype_str = sa.kv_cache_dtype
    a.kv_layout = None
    a.prefill_start_layer = 0
    a.prefill_end_layer = scenario.num_layers
    # get_contiguous_buf_infos: the registered part of each buffer stops before the guard pages
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [pool_pages * scenario.page_bytes for _ in kv]
    a.kv_item_lens = [scenario.page_bytes for _ in kv]
    a.num_draft_entries = 0
    a.kv_layer_ids = scenario.kv_layer_ids()
    if role == "prefill" and not is_mla_backend(scenario):
        # prefill.py: `if not self.is_mla_backend` (decode.py sets these only for its staging buffer)
        a.kv_head_num = 1 if scenario.mla else HEAD_NUM  # pool.head_num (an MLA sub-pool has one latent head)
        a.total_kv_head_num = a.kv_head_num
    a.page_size = PAGE_SIZE
    a.aux_data_ptrs = [t.data_ptr() for t in aux]
    a.aux_data_lens = [t.numel() * t.element_size() for t in aux]
    a.aux_item_lens = [AUX_ITEM_BYTES for _ in aux]
    a.ib_device = sa.disaggregation_ib_device
    a.gpu_id = 0
    # setup_state_kv_args: no state components (a hybrid pool's mamba state is not moved here)
    a.state_types = []
    a.state_data_ptrs = []
    a.state_data_lens = []
    a.state_item_lens = []
    a.state_dim_per_tensor = []
    a.state_slice_outer_counts = []
    a.state_layer_ids = []
    a.state_conv_shard_groups = []
    a.swa_kv_cache_layout = None
    a.mla_compression_ratios = None
    a.is_hybrid_mla_backend = scenario.hybrid and scenario.mla
    return a


def make_manager(scenario: Scenario, role: str, mode: str, sa: Any, kv_args: Any) -> Any:
    """The manager class sglang's ``get_kv_class`` returns, built as the scheduler builds it; its class checked."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    cls = get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)
    if mode == "kvwire":
        assert cls.__name__ == "KvwireKVManager", f"get_kv_class gave {cls.__module__}.{cls.__qualname__}"
    else:
        assert cls.__name__ == "MooncakeKVManager", f"get_kv_class gave {cls.__module__}.{cls.__qualname__}"
    dmode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = cls(kv_args, dmode, sa, is_mla_backend(scenario))
    if mode == "kvwire":
        assert type(mgr).__name__ == "KvwireKVManager", type(mgr)
    return mgr


def count_kvwire_sends(mgr: Any) -> list[dict[str, Any]]:
    """Record every call sglang's worker makes into ``mgr.kvwire_connection.send_kvcache`` (a list, filled in place)."""
    calls: list[dict[str, Any]] = []
    conn = mgr.kvwire_connection
    inner: Callable[..., Any] = conn.send_kvcache

    def send_kvcache(*args: Any, **kwargs: Any) -> Any:
        call: dict[str, Any] = {"session": str(args[0]) if args else None}
        calls.append(call)
        try:
            call["bytes"] = inner(*args, **kwargs)
        except BaseException as exc:
            call["error"] = f"{type(exc).__name__}: {exc}"
            raise
        return call["bytes"]

    conn.send_kvcache = send_kvcache
    return calls


class Clock:
    """This side's deadline, and the other side's result file: once that exists the other side has exited.

    Every wait checks both, so a side whose peer broke gives up within
    ``grace_s`` instead of at the deadline (the grace lets sglang's last status
    message arrive when the peer finished normally).
    """

    def __init__(self, deadline: float, peer_result: Path, grace_s: float = 3.0) -> None:
        self.deadline, self.peer_result, self.grace_s = deadline, peer_result, grace_s
        self._peer_gone_at: float | None = None

    def check(self, what: str) -> None:
        """Raise if the deadline passed (TimeoutError) or the peer exited over ``grace_s`` ago (RuntimeError)."""
        now = time.monotonic()
        if now > self.deadline:
            raise TimeoutError(f"{what}: timed out")
        if self.peer_result.exists():
            self._peer_gone_at = self._peer_gone_at or now
            if now - self._peer_gone_at > self.grace_s:
                raise RuntimeError(f"{what}: the {self.peer_result.stem} side exited first (see its result)")

    def poll_until(self, poll: Callable[[], int], done: set[int], what: str) -> int:
        """Poll an sglang sender/receiver until its KVPoll state is in ``done``."""
        while True:
            state = int(poll())
            if state in done:
                return state
            self.check(f"{what} (still in KVPoll state {kvpoll_name(state)})")
            time.sleep(0.02)

    def wait_for_file(self, path: Path, what: str) -> None:
        while not path.exists():
            self.check(what)
            time.sleep(0.05)


def failure_reason(obj: Any) -> str | None:
    """sglang's recorded reason for a Failed sender/receiver (its ``failure_exception``)."""
    try:
        obj.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# -- the two roles ------------------------------------------------------------------------------


def run_prefill(args: argparse.Namespace, scenario: Scenario, clock: Clock) -> dict[str, Any]:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    work = Path(args.workdir)
    sa = publish_server_args("prefill", args.bootstrap_port)
    server = get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=args.bootstrap_port
    )
    kv, aux = kv_buffers(scenario, "prefill"), aux_buffers("prefill")
    mgr = make_manager(scenario, "prefill", args.mode, sa, build_kv_args(scenario, "prefill", sa, kv, aux))
    calls = count_kvwire_sends(mgr) if args.mode == "kvwire" else None
    sender = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER)(
        mgr=mgr, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=args.room
    )
    (work / "prefill.ready").touch()

    # as PrefillBootstrapQueue: wait for the decode's metadata, then init; then send the pages
    state = clock.poll_until(sender.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, "prefill bootstrap")
    if state == KVPoll.WaitingForInput:
        sender.init(len(scenario.src_pages), aux_index=AUX_INDEX)
        sender.send(np.asarray(scenario.src_pages, dtype=np.int32))
        state = clock.poll_until(sender.poll, {KVPoll.Success, KVPoll.Failed}, "prefill transfer")
    result: dict[str, Any] = {
        "manager": f"{type(mgr).__module__}.{type(mgr).__qualname__}",
        "kvpoll": kvpoll_name(state),
        "failure": failure_reason(sender) if state == KVPoll.Failed else None,
        "failed_sessions": sorted(mgr.failed_sessions),
    }
    if calls is not None:
        result["kvwire_sends"] = len(calls)
        result["kvwire_calls"] = calls
    clock.wait_for_file(work / "decode.done", "waiting for the decode to verify")
    server.close()
    return result


def run_decode(args: argparse.Namespace, scenario: Scenario, clock: Clock) -> dict[str, Any]:
    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    work = Path(args.workdir)
    sa = publish_server_args("decode", args.bootstrap_port)
    kv, aux = kv_buffers(scenario, "decode"), aux_buffers("decode")
    before = [t.clone() for t in kv]
    mgr = make_manager(scenario, "decode", args.mode, sa, build_kv_args(scenario, "decode", sa, kv, aux))

    clock.wait_for_file(work / "prefill.ready", "waiting for the prefill to start")
    addr = f"127.0.0.1:{args.bootstrap_port}"
    while not mgr.try_ensure_parallel_info(addr):
        clock.check(f"fetching the prefill's parallel info from {addr}")
        time.sleep(0.2)
    receiver = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)(
        mgr=mgr, bootstrap_addr=addr, bootstrap_room=args.room
    )
    receiver.init(0)
    state = clock.poll_until(receiver.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, "decode bootstrap")
    if state == KVPoll.WaitingForInput:
        receiver.send_metadata(np.asarray(scenario.dst_pages, dtype=np.int32), aux_index=AUX_INDEX)
        state = clock.poll_until(receiver.poll, {KVPoll.Success, KVPoll.Failed}, "decode transfer")
    reason = failure_reason(receiver) if state == KVPoll.Failed else None

    # byte-exact check of every KV buffer, guard pages included: after Success the destination pages
    # hold the source pages and nothing else changed; after Failed nothing at all changed
    src = kv_buffers(scenario, "prefill")
    pairs = list(zip(scenario.src_pages, scenario.dst_pages)) if state == KVPoll.Success else []
    written = {d for _, d in pairs}
    mismatches: list[str] = []
    changed: list[str] = []
    for b, (now, old, want) in enumerate(zip(kv, before, src)):
        now_b, old_b, want_b = page_bytes_view(now), page_bytes_view(old), page_bytes_view(want)
        for s, d in pairs:
            if not torch.equal(now_b[d], want_b[s]):
                mismatches.append(f"buffer {b} page {d} != prefill page {s}")
        for p in range(DECODE_PAGES + GUARD_PAGES):
            if p not in written and not torch.equal(now_b[p], old_b[p]):
                changed.append(f"buffer {b} {'guard ' if p >= DECODE_PAGES else ''}page {p}")
    result = {
        "manager": f"{type(mgr).__module__}.{type(mgr).__qualname__}",
        "kvpoll": kvpoll_name(state),
        "failure": reason,
        "pages_checked": len(pairs) * len(kv),  # destination pages compared with their source pages
        "mismatches": mismatches,
        "other_pages_changed": changed,  # every other page (guards included) that differs from before
        "pages_compared_unchanged": (DECODE_PAGES + GUARD_PAGES - len(written)) * len(kv),
    }
    (work / "decode.done").touch()
    return result


def kvpoll_name(state: int) -> str:
    """The name of a KVPoll state (sglang keeps them as plain ints)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    names = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int) and not k.startswith("_")}
    return str(names.get(state, state))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--room", type=int, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--timeout-s", type=float, default=90.0)
    args = p.parse_args()
    deadline = time.monotonic() + args.timeout_s
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.workdir) / f"{args.role}.json"
    started = time.monotonic()
    result: dict[str, Any] = {"role": args.role, "scenario": args.scenario, "mode": args.mode}
    try:
        if args.mode == "kvwire":
            assert os.environ.get("SGLANG_PLUGINS") == "kvwire", "kvwire mode needs SGLANG_PLUGINS=kvwire"
            from sglang.srt.plugins import load_plugins

            load_plugins()  # as sglang's scheduler process does, before any manager is built
        run = run_prefill if args.role == "prefill" else run_decode
        peer = "decode" if args.role == "prefill" else "prefill"
        result.update(run(args, SCENARIOS[args.scenario], Clock(deadline, Path(args.workdir) / f"{peer}.json")))
        result["ok"] = True
    except BaseException as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    result["seconds"] = round(time.monotonic() - started, 2)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.rename(out)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
    if args.role == "decode" and not (Path(args.workdir) / "decode.done").exists():
        (Path(args.workdir) / "decode.done").touch()  # let the prefill go even when the decode broke
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
