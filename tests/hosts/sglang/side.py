"""One process (a prefill or a decode TP rank) of a KV transfer run by sglang 0.5.23's own disaggregation code on CPU.

Run by :mod:`pair` with the sglang venv's python, never imported by the repo's tests::

    python side.py --role prefill|decode --scenario plain-mha --mode stock|kvwire \\
        --bootstrap-port P --room R --workdir DIR --timeout-s 90 [--rank N] [--server N]

What is sglang's here and what is not: ``ServerArgs``, the published runtime context
(``publish`` with this process's ``SpawnRanks``, from which sglang derives ``tp_rank``,
``attn_tp_size`` and ``attn_tp_rank`` as its launcher does), the shared Mooncake
engine (``maybe_init_shared_mooncake_transfer_engine``, over TCP),
``MooncakeKVBootstrapServer``, the manager class ``get_kv_class`` returns (which
registers the pools with the engine, registers each prefill rank with the
bootstrap server and, on the prefill, starts the ``transfer_worker`` threads that
call ``send_kvcache`` / ``send_kvcache_slice``), ``MooncakeKVSender`` and
``MooncakeKVReceiver``, all sglang's. Ours: the KV pools (CPU fp16 tensors of
random bytes standing in for a model's pools), ``KVArgs`` filled the way sglang's
``PrefillBootstrapQueue`` / ``DecodePreallocQueue._init_kv_manager`` fill it for
that pool shape and rank (draft-model KV appended, a HiSparse decode's
``device_kv_indices`` sent, as sglang does), and one stand-in, the ``pp_group``
(there is no torch.distributed): one rank, or for a prefill of several pipeline
stages :class:`FilePpGroup`, whose one collective (``broadcast_object``, used by
sglang's ``PPConsensusStore``) goes through a file; nothing else of sglang's reads
a process group here.

Processes: a scenario has ``prefill_tp`` prefill ranks (one prefill server; rank 0
also hosts its bootstrap server, as the prefill server's main process does) and
``decode_servers`` decode servers of ``decode_tp`` ranks each; every process is one
TP rank (of one pipeline stage, ``--stage``, when the prefill has ``prefill_pp``) with
its own engine and manager, as in a real deployment. Each decode
server has its own request (bootstrap room) per repetition. See
:meth:`Scenario.processes` for the process names.

In ``kvwire`` mode the process calls ``sglang.srt.plugins.load_plugins()`` first, as
sglang's scheduler does, and ``SGLANG_PLUGINS=kvwire`` selects kvwire-sglang's plugin.

Coordination goes through files in ``--workdir`` (``NAME`` is a process name):
``bootstrap.up`` once prefill rank 0's bootstrap server listens; ``NAME.ready`` once a
prefill rank's manager and senders exist; ``NAME.waiting`` once a prefill rank's
requests of repetition ``killed_at_rep`` reached WaitingForInput (every decode's
metadata arrived);
``NAME.metadata_sent`` when a decode rank that is to be killed sent its metadata
(the driver then SIGKILLs it and writes ``NAME.killed``); ``NAME.done`` after a decode
rank verified, so the prefill keeps its bootstrap server up until then. Each
process writes its result to ``NAME.json`` (and prints it as one JSON line) and
exits with ``os._exit`` (sglang's daemon threads and the Mooncake engine never
join); a process gives up waiting once another broke, or once all others exited.

Each decode KV buffer is followed by guard pages outside what sglang registers
(``kv_data_lens`` stops before them), so a write past the pool is seen, not lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
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
#: At most this many mismatch descriptions are kept per decode rank (all are counted).
MISMATCH_LIMIT = 50


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process of a scenario: a TP rank of a prefill or decode server."""

    name: str
    role: str
    server: int  # decode server index (always 0 for the prefill)
    rank: int  # TP rank within its server
    stage: int = 0  # pipeline stage (a prefill of prefill_pp stages; always 0 for the decode)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A pool shape, the servers and ranks, and the pages one request moves.

    ``layer_ids`` is None for a plain pool (sglang's ``build_kv_layer_ids`` gives
    ``[]``); for a hybrid (``HybridLinearKVPool``) pool it is the full-attention
    layers' global ids, and ``kv_layer_ids`` is ``layer_ids * 2`` (MHA) or
    ``layer_ids`` (MLA), as sglang's ``get_kv_layer_ids`` returns them.

    MHA pools hold ``kv_heads`` KV heads in all (the model's), split over the
    attention-TP ranks as sglang splits them (:meth:`heads_of`). Decode server
    ``s`` asks for ``dst_pages`` and is sent ``src_pages`` shifted by ``s``
    (:meth:`src_pages_of`), so two requests cannot be mixed up unseen.
    ``killed_decode``: that decode server's ranks are SIGKILLed after sending
    their metadata for request ``killed_at_rep`` (the earlier ones succeed, so the
    prefill's engine already talked to them), before the prefill sends it; that
    request must turn Failed on the prefill within ``fail_within_s``. ``repeats``:
    requests per decode server, one after the other (the destination pages are
    zeroed between them).

    Draft-model KV (speculative decoding): ``draft_layers`` layers of a draft pool of
    the same page shape, appended after the target's buffers as sglang appends them
    (``num_draft_entries``), on the decode and, unless ``prefill_draft`` is False (a
    prefill deployed without speculative decoding), on the prefill. A hybrid pool
    numbers them in sglang's band, ``num_hidden_layers + i``. ``hisparse``: the decode
    runs with ``enable_hisparse``: its target buffers are its host pool and its draft
    buffers device buffers, addressed by the ``device_dst_pages`` it sends as sglang's
    ``device_kv_indices``. ``prefill_backend``: the kvwire backend the prefill's
    manager is forced to (None: kvwire-sglang's own choice).
    """

    name: str
    mla: bool
    num_layers: int
    layer_ids: tuple[int, ...] | None
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    expect_success: bool = True
    prefill_tp: int = 1
    decode_tp: int = 1
    kv_heads: int = HEAD_NUM
    head_dim: int = HEAD_DIM
    page_size: int = PAGE_SIZE
    prefill_pages: int = PREFILL_PAGES
    decode_pages: int = DECODE_PAGES
    decode_servers: int = 1
    killed_decode: int | None = None
    killed_at_rep: int = 0
    fail_within_s: float = 30.0
    repeats: int = 1
    bench: bool = False  # a throughput shape: left out of the default runs
    draft_layers: int = 0
    prefill_draft: bool = True
    num_hidden_layers: int = 6  # sglang's model_config.num_hidden_layers: the base of a hybrid pool's draft band
    hisparse: bool = False
    device_dst_pages: tuple[int, ...] = ()
    prefill_backend: str | None = None
    prefill_pp: int = 1  # pipeline stages of the prefill (the decode has one): each holds its share of the layers

    @property
    def hybrid(self) -> bool:
        return self.layer_ids is not None

    @property
    def num_buffers(self) -> int:
        """The target model's KV buffer count: K of every layer then V of every layer (MHA), one per layer (MLA)."""
        return self.num_layers if self.mla else 2 * self.num_layers

    def draft_entries(self, role: str) -> int:
        """``KVArgs.num_draft_entries`` of ``role``: the draft pool's buffers appended after the target's."""
        if role == "prefill" and not self.prefill_draft:
            return 0
        return self.draft_layers if self.mla else 2 * self.draft_layers

    def buffers_of(self, role: str) -> int:
        """Every KV buffer ``role`` registers: the target's, then the draft's."""
        return self.num_buffers + self.draft_entries(role)

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def pool_pages(self, role: str) -> int:
        return self.prefill_pages if role == "prefill" else self.decode_pages

    def heads_of(self, tp: int, rank: int) -> range:
        """The global KV heads rank ``rank`` of ``tp`` holds: contiguous slices, one replicated head when fewer.

        sglang's split (``kv_head_num = max(1, total // tp)``, head ``rank // (tp // total)``
        when ``total < tp``). An MLA pool has one latent "head", held whole by every rank.
        """
        if self.mla:
            return range(1)
        if self.kv_heads >= tp:
            per = self.kv_heads // tp
            return range(rank * per, rank * per + per)
        head = rank // (tp // self.kv_heads)
        return range(head, head + 1)

    def row_shape(self, heads: int) -> tuple[int, int]:
        """One token of one page: (heads, elements per head)."""
        return (1, MLA_DIM) if self.mla else (heads, self.head_dim)

    def page_bytes(self, role: str) -> int:
        """Bytes of one page of one buffer on a rank of ``role`` (sglang's ``kv_item_lens``)."""
        heads, dim = self.row_shape(len(self.heads_of(self.tp(role), 0)))
        return self.page_size * heads * dim * 2

    def kv_layer_ids(self, role: str = "prefill", stage: int = 0) -> list[int]:
        """``KVArgs.kv_layer_ids`` of ``role`` as sglang's ``build_kv_layer_ids`` builds it for this pool.

        A draft pool's entries are remapped by sglang's own ``_remap_draft_layer_ids``
        into the band above ``num_hidden_layers`` (imported, so only in the sglang venv).
        A prefill pipeline stage's pool reports its own layers' ids.
        """
        if self.layer_ids is None:
            return []
        ids = list(self.layer_ids)
        if role == "prefill" and self.prefill_pp > 1:
            ids = [ids[i] for i in self.stage_layers(stage)]
        target = ids if self.mla else ids * 2
        drafts = self.draft_entries(role)
        if not drafts:
            return target
        from sglang.srt.disaggregation.utils import _remap_draft_layer_ids

        # _draft_entry_layer_ids of a plain draft pool: its layers 0..n-1 once per K/V group
        draft_ids = list(range(self.draft_layers)) * (drafts // self.draft_layers)
        return target + [int(i) for i in _remap_draft_layer_ids(draft_ids, self.num_hidden_layers)]

    def sources(self) -> list[tuple[int | None, bool]]:
        """For each decode buffer: the prefill buffer that fills it (None: nothing may), and whether its pages
        are the device ones (``device_dst_pages``: a HiSparse decode's draft buffers)."""
        fill = self.buffers_of("prefill")
        return [
            (i if i < fill else None, self.hisparse and i >= self.num_buffers) for i in range(self.buffers_of("decode"))
        ]

    def src_pages_of(self, server: int) -> tuple[int, ...]:
        """The prefill pages decode server ``server``'s request moves (``src_pages`` shifted by ``server``)."""
        return tuple((p + server) % self.prefill_pages for p in self.src_pages)

    def room(self, base: int, rep: int, server: int) -> int:
        """The bootstrap room of decode server ``server``'s request in repetition ``rep``."""
        return base + rep * self.decode_servers + server

    def processes(self) -> list[Proc]:
        """Every process, prefill ranks first.

        Names: ``prefill`` and ``decode`` for rank 0 (of decode server 0), ``-rN`` added
        for TP rank N, ``-sN`` for decode server N, ``-pN`` for pipeline stage N of the
        prefill (``prefill-r1``, ``decode-r1``, ``decode-s1``, ``prefill-p1``).
        """
        procs = [
            Proc("prefill" + (f"-p{st}" if st else "") + (f"-r{r}" if r else ""), "prefill", 0, r, st)
            for st in range(self.prefill_pp)
            for r in range(self.prefill_tp)
        ]
        for s in range(self.decode_servers):
            for r in range(self.decode_tp):
                name = "decode" + (f"-s{s}" if s else "") + (f"-r{r}" if r else "")
                procs.append(Proc(name, "decode", s, r))
        return procs

    def proc(self, role: str, server: int, rank: int, stage: int = 0) -> Proc:
        (found,) = [p for p in self.processes() if (p.role, p.server, p.rank, p.stage) == (role, server, rank, stage)]
        return found

    def stage_layers(self, stage: int) -> range:
        """The layers pipeline stage ``stage`` of the prefill holds (sglang's ``start_layer``..``end_layer``)."""
        per = self.num_layers // self.prefill_pp
        return range(stage * per, stage * per + per)

    def killed(self) -> list[Proc]:
        """The processes the driver SIGKILLs (every rank of decode server ``killed_decode``)."""
        return [p for p in self.processes() if p.role == "decode" and p.server == self.killed_decode]


#: Source and destination pages: out of order, not contiguous, a run of two (7, 8 -> 3, 4).
_SRC, _DST = (2, 7, 8, 0), (9, 3, 4, 11)
#: A HiSparse decode's device pages for the same request: ids of their own (7, 8 -> 10, 11).
_DEVICE_DST = (5, 10, 11, 1)


_KILLED = Scenario(
    "killed-decode",
    mla=False,
    num_layers=2,
    layer_ids=None,
    src_pages=_SRC,
    dst_pages=_DST,
    decode_servers=2,
    killed_decode=0,
)


def bench_scenario(name: str, moved: int, repeats: int) -> Scenario:
    """A throughput shape: 2 layers x K/V of pages of 32 tokens x 8 heads x 128 dims fp16 = 64 KiB.

    ``moved`` pages per request, in a random order on both sides (seeded: the same in
    both modes), so runs of pages consecutive on both sides, which a sender could
    merge, are rare; pools of ``moved * 1.5`` (prefill) and ``moved * 1.75`` pages.
    ``repeats`` requests, one after the other: the first is the warm-up.
    """
    rng = random.Random(20251201 + moved)
    prefill_pages, decode_pages = moved * 3 // 2, moved * 7 // 4
    return Scenario(
        name,
        mla=False,
        num_layers=2,
        layer_ids=None,
        src_pages=tuple(rng.sample(range(prefill_pages), moved)),
        dst_pages=tuple(rng.sample(range(decode_pages), moved)),
        kv_heads=8,
        head_dim=128,
        page_size=32,
        prefill_pages=prefill_pages,
        decode_pages=decode_pages,
        repeats=repeats,
        bench=True,
    )


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
        # Attention TP 1 -> 2: the prefill rank holds heads 0..3, decode rank d heads 2d, 2d+1.
        Scenario(
            "tp-1-2", mla=False, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST, decode_tp=2, kv_heads=4
        ),
        # Attention TP 2 -> 1: prefill rank p holds heads 2p, 2p+1; both fill the one decode rank's pages.
        Scenario(
            "tp-2-1", mla=False, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST, prefill_tp=2, kv_heads=4
        ),
        # Two decode servers, two requests; the first decode is SIGKILLed after sending its metadata.
        _KILLED,
        # The same, but the first decode dies after a first request to each decode succeeded.
        dataclasses.replace(_KILLED, name="killed-decode-warm", killed_at_rep=1, repeats=2),
        # Draft-model KV (speculative decoding): 2 draft layers appended after the 2 target layers, on both sides.
        Scenario("draft-mha", mla=False, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST, draft_layers=2),
        Scenario("draft-mla", mla=True, num_layers=2, layer_ids=None, src_pages=_SRC, dst_pages=_DST, draft_layers=2),
        # Hybrid pools: the draft's entries in sglang's band, num_hidden_layers (6) + i.
        Scenario(
            "draft-hybrid-mha",
            mla=False,
            num_layers=2,
            layer_ids=(3, 5),
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=2,
        ),
        # The decode has a draft layer, the prefill none (sglang's get_mha_kv_ptrs_with_pp case): it stays unwritten.
        Scenario(
            "draft-decode-only",
            mla=False,
            num_layers=2,
            layer_ids=None,
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=1,
            prefill_draft=False,
        ),
        # The same with as many draft layers as target layers: sglang's positional pairing writes the target's V
        # into the decode's draft K buffers here (get_mha_kv_ptrs_with_pp); kvwire pairs by layer.
        Scenario(
            "draft-decode-only-2",
            mla=False,
            num_layers=2,
            layer_ids=None,
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=2,
            prefill_draft=False,
        ),
        # HiSparse decode: the target KV in its host pool, the draft KV on the device with device page ids.
        Scenario(
            "hisparse-mla",
            mla=True,
            num_layers=2,
            layer_ids=None,
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=1,
            hisparse=True,
            device_dst_pages=_DEVICE_DST,
        ),
        Scenario(
            "hisparse-mha",
            mla=False,
            num_layers=2,
            layer_ids=None,
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=1,
            hisparse=True,
            device_dst_pages=_DEVICE_DST,
        ),
        # The same, the prefill forced onto kvwire-mooncake (no device_kv_indices): refused, nothing written.
        Scenario(
            "hisparse-on-mooncake",
            mla=True,
            num_layers=2,
            layer_ids=None,
            src_pages=_SRC,
            dst_pages=_DST,
            draft_layers=1,
            hisparse=True,
            device_dst_pages=_DEVICE_DST,
            expect_success=False,
            prefill_backend="mooncake",
        ),
        # A prefill of 2 pipeline stages (layers 0-1 and 2-3, each its own process) into one decode of 4 layers.
        Scenario("pp-2-1", mla=False, num_layers=4, layer_ids=None, src_pages=_SRC, dst_pages=_DST, prefill_pp=2),
        # The same with a hybrid pool: each stage reports its layers' ids (3, 5 and 7, 9), the decode all four.
        Scenario(
            "pp-2-1-hybrid",
            mla=False,
            num_layers=4,
            layer_ids=(3, 5, 7, 9),
            src_pages=_SRC,
            dst_pages=_DST,
            prefill_pp=2,
        ),
        # Throughput shapes (bench/sglang_throughput.py): 16 MiB and 64 MiB per request.
        bench_scenario("throughput", moved=64, repeats=9),
        bench_scenario("throughput-256", moved=256, repeats=9),
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


def global_kv_buffers(scenario: Scenario, role: str, server: int = 0) -> list[Any]:
    """One server's KV buffers holding every KV head, [pages + guard, tokens, heads, dim], in sglang's order.

    What all TP ranks of the server hold together (each rank has its heads' slice);
    seeded by role and decode server, so any process can rebuild any of them.
    """
    pages = scenario.pool_pages(role) + GUARD_PAGES
    heads, dim = scenario.row_shape(scenario.kv_heads)
    base = 1000 if role == "prefill" else 2000 + 100 * server
    return [random_bytes(base + i, (pages, scenario.page_size, heads, dim)) for i in range(scenario.buffers_of(role))]


def kv_buffers(scenario: Scenario, role: str, rank: int = 0, server: int = 0, stage: int = 0) -> list[Any]:
    """The KV buffers of one rank's pool (its heads of :func:`global_kv_buffers`, guard pages included).

    A prefill pipeline stage holds its layers' buffers (K of each, then V of each).
    """
    heads = scenario.heads_of(scenario.tp(role), rank)
    whole = global_kv_buffers(scenario, role, server)
    if role == "prefill" and scenario.prefill_pp > 1:
        assert not scenario.draft_layers, "a pipeline-parallel prefill with draft KV is not a scenario here"
        layers = list(scenario.stage_layers(stage))
        picks = layers if scenario.mla else layers + [scenario.num_layers + i for i in layers]
        whole = [whole[i] for i in picks]
    if scenario.mla or len(heads) == scenario.kv_heads:
        return whole
    return [t[:, :, heads.start : heads.stop, :].contiguous() for t in whole]


def aux_buffers(role: str) -> list[Any]:
    """Stand-ins for sglang's ``MetadataBuffers``: sglang sends them on its own path; they are not verified."""
    base = 3000 if role == "prefill" else 4000
    return [random_bytes(base + i, (AUX_SLOTS, AUX_ITEM_BYTES // 2)) for i in range(AUX_BUFFERS)]


def head_bytes_view(t: Any) -> Any:
    """``t`` [page, token, head, dim] as uint8 [page, token, head, bytes of one head], for byte-exact comparisons."""
    import torch

    return t.view(torch.uint8)


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


class FilePpGroup:
    """Stand-in for sglang's ``pp_group`` of a prefill with several pipeline stages, one process each.

    sglang's ``PPConsensusStore`` (the prefill's request status when ``pp_size > 1``) uses
    the group once, to broadcast stage 0's ZMQ address (``broadcast_object``); the rest
    is its own ZMQ. Here stage 0 writes the object to a file in the work directory and
    the other stages read it.
    """

    def __init__(self, stage: int, stages: int, workdir: Path) -> None:
        self.rank_in_group, self.world_size, self.workdir = stage, stages, workdir
        self.is_first_rank, self.is_last_rank = stage == 0, stage == stages - 1
        self.ranks = tuple(range(stages))
        self._calls = 0

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import pickle

        self._calls += 1
        path = self.workdir / f"pp-broadcast-{self._calls}.pickle"
        if self.rank_in_group == src:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(obj))
            tmp.rename(path)
            return obj
        deadline = time.monotonic() + 60
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"pp_group.broadcast_object: {path} never appeared")
            time.sleep(0.02)
        return pickle.loads(path.read_bytes())


def is_mla_backend(scenario: Scenario) -> bool:
    """sglang's ``is_mla_backend(token_to_kv_pool)``: True for an MLA pool, False for a hybrid (linear) pool."""
    return scenario.mla and not scenario.hybrid


def publish_server_args(
    scenario: Scenario, role: str, rank: int, bootstrap_port: int, stage: int = 0, workdir: Path | None = None
) -> Any:
    """sglang's ``ServerArgs`` for this role (``tp_size`` of its server), published for TP rank ``rank``.

    ``publish(..., ranks=SpawnRanks(world_rank=rank))`` is what sglang's launcher does
    for each scheduler process: sglang derives ``tp_rank``, ``attn_tp_size`` and
    ``attn_tp_rank`` from it (and ``CommonKVManager`` reads them there). Checked.
    A prefill of ``prefill_pp`` stages: world rank ``rank + tp_size * stage``, from
    which sglang derives ``pp_rank``, and the :class:`FilePpGroup` stand-in.
    """
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    tp = scenario.tp(role)
    pp = scenario.prefill_pp if role == "prefill" else 1
    sa = ServerArgs(
        model_path="dummy",
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        host="127.0.0.1",
        disaggregation_bootstrap_port=bootstrap_port,
        device="cpu",
        page_size=scenario.page_size,
        tp_size=tp,
        enable_hisparse=scenario.hisparse and role == "decode",
        pp_size=pp,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank + tp * stage, gpu_id=rank))
    parallel = get_parallel()
    group = OnePpRankGroup() if pp == 1 else FilePpGroup(stage, pp, workdir or Path("."))
    parallel.override_permanently(pp_group=group)
    got = (parallel.tp_rank, parallel.attn_tp_size, parallel.attn_tp_rank, parallel.pp_size, parallel.pp_rank)
    want = (rank, tp, rank, pp, stage)
    assert got == want, f"sglang derived (tp_rank, attn_tp_size, attn_tp_rank, pp_size, pp_rank) = {got}"
    # sglang's own choice of engine: mooncake PD -> init_mooncake_transfer_engine(get_local_ip_auto(), ...)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=rank)
    return sa


def build_kv_args(
    scenario: Scenario, role: str, rank: int, sa: Any, kv: list[Any], aux: list[Any], stage: int = 0
) -> Any:
    """``KVArgs`` as sglang's ``_init_kv_manager`` fills it (prefill.py / decode.py), for TP rank ``rank``.

    A prefill pipeline stage: ``pp_rank`` and its layers' ``prefill_start_layer`` / ``prefill_end_layer``.
    """
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    page_bytes = scenario.page_bytes(role)
    a = get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS)()
    # prefill.py: engine_rank = self.tp_rank; decode.py: self.tp_rank % attn_tp_size (the same here)
    a.engine_rank = rank % scenario.tp(role)
    a.pp_rank = stage
    a.system_dp_rank = None  # get_parallel().dp_rank: no data-parallel controller
    a.rust_http_port = None
    a.kv_cache_dtype_str = sa.kv_cache_dtype
    a.kv_layout = None
    layers = scenario.stage_layers(stage) if role == "prefill" else range(scenario.num_layers)
    a.prefill_start_layer = layers.start  # prefill.py: the pool's start_layer (a stage's first layer)
    a.prefill_end_layer = layers.stop
    # get_contiguous_buf_infos: the registered part of each buffer stops before the guard pages
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [scenario.pool_pages(role) * page_bytes for _ in kv]
    a.kv_item_lens = [page_bytes for _ in kv]
    # prefill.py / decode.py: the draft pool's buffers appended after the target's (a HiSparse decode: its
    # target buffers from the host pool, its draft's from the device pool; all CPU tensors here)
    a.num_draft_entries = scenario.draft_entries(role)
    a.kv_layer_ids = scenario.kv_layer_ids(role, stage)
    if role == "prefill" and not is_mla_backend(scenario):
        # prefill.py: `if not self.is_mla_backend` (decode.py sets these only for its staging buffer):
        # pool.head_num (this rank's heads; an MLA sub-pool has one latent head) and the model's total
        a.kv_head_num = 1 if scenario.mla else len(scenario.heads_of(scenario.prefill_tp, rank))
        a.total_kv_head_num = 1 if scenario.mla else scenario.kv_heads
    a.page_size = scenario.page_size
    a.aux_data_ptrs = [t.data_ptr() for t in aux]
    a.aux_data_lens = [t.numel() * t.element_size() for t in aux]
    a.aux_item_lens = [AUX_ITEM_BYTES for _ in aux]
    a.ib_device = sa.disaggregation_ib_device
    a.gpu_id = rank
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
    if mode == "kvwire" and role == "prefill" and scenario.prefill_backend is not None:
        cls.kvwire_backend = scenario.prefill_backend  # a deployment's subclass would set it the same way
    mgr = cls(kv_args, dmode, sa, is_mla_backend(scenario))
    if mode == "kvwire":
        assert type(mgr).__name__ == "KvwireKVManager", type(mgr)
    return mgr


def layout_labels(mgr: Any) -> list[list[Any]] | None:
    """(layer, role, memory) of each buffer of kvwire's layout of this rank (None: sglang's own manager)."""
    layout = getattr(mgr, "kvwire_layout", None)
    return None if layout is None else [[b.layer, b.role, b.memory] for b in layout.buffers]


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
    """This process's deadline, and the other processes' result files.

    Every wait checks both, so a process gives up within ``grace_s`` once another
    broke (its result says ``ok: false``) or once every other process has exited
    (a result or a ``.killed`` marker), instead of at the deadline. The grace lets
    sglang's last status message arrive when the others finished normally.
    """

    def __init__(self, deadline: float, workdir: Path, peers: Sequence[str], grace_s: float = 3.0) -> None:
        self.deadline, self.workdir, self.peers, self.grace_s = deadline, workdir, tuple(peers), grace_s
        self._ok: dict[str, bool] = {}  # the peers whose result was read (final once it exists)
        self._trouble_at: float | None = None

    def _trouble(self) -> str | None:
        """Why waiting on is pointless: a peer broke, or all exited; None while that is not so."""
        gone = 0
        for peer in self.peers:
            if peer not in self._ok:
                path = self.workdir / f"{peer}.json"
                if path.exists():
                    self._ok[peer] = bool(json.loads(path.read_text()).get("ok"))
                elif (self.workdir / f"{peer}.killed").exists():
                    self._ok[peer] = True  # killed on purpose by the driver
            if peer in self._ok:
                gone += 1
                if not self._ok[peer]:
                    return f"the {peer} process broke (see its result)"
        if self.peers and gone == len(self.peers):
            return "every other process exited first (see their results)"
        return None

    def check(self, what: str) -> None:
        """Raise if the deadline passed (TimeoutError), or a peer broke or all exited over ``grace_s`` ago."""
        now = time.monotonic()
        if now > self.deadline:
            raise TimeoutError(f"{what}: timed out")
        trouble = self._trouble()
        if trouble is not None:
            self._trouble_at = self._trouble_at or now
            if now - self._trouble_at > self.grace_s:
                raise RuntimeError(f"{what}: {trouble}")

    def poll_until(self, poll: Callable[[], int], done: set[int], what: str) -> int:
        """Poll an sglang sender/receiver until its KVPoll state is in ``done``."""
        while True:
            state = int(poll())
            if state in done:
                return state
            self.check(f"{what} (still in KVPoll state {kvpoll_name(state)})")
            time.sleep(0.02)

    def poll_all_timed(self, polls: dict[int, Callable[[], int]], done: set[int], what: str) -> dict[int, Any]:
        """Poll several senders until each is in ``done``: {key: (state, time.perf_counter() when seen)}.

        Polls every millisecond, so the times are within about a millisecond of sglang's status change.
        """
        seen: dict[int, Any] = {}
        while len(seen) < len(polls):
            for key, poll in polls.items():
                if key not in seen:
                    state = int(poll())
                    if state in done:
                        seen[key] = (state, time.perf_counter())
            if len(seen) < len(polls):
                self.check(f"{what} ({len(seen)} of {len(polls)} requests concluded)")
                time.sleep(0.001)
        return seen

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


def common_state(states: Sequence[str]) -> str:
    """The one KVPoll state all requests ended in, or ``mixed: a, b, ...``."""
    return states[0] if len(set(states)) == 1 else "mixed: " + ", ".join(states)


# -- the two roles ------------------------------------------------------------------------------


def run_prefill(args: argparse.Namespace, scenario: Scenario, clock: Clock) -> dict[str, Any]:
    """One prefill TP rank: senders for every request, each request sent once all decodes are waiting for it."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    work = Path(args.workdir)
    me = scenario.proc("prefill", 0, args.rank, args.stage)
    sa = publish_server_args(scenario, "prefill", args.rank, args.bootstrap_port, args.stage, work)
    server = None
    if args.rank == 0 and args.stage == 0:  # the prefill server's bootstrap server (its main process's, in sglang)
        server = get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER)(
            host="127.0.0.1", port=args.bootstrap_port
        )
        (work / "bootstrap.up").touch()
    else:
        clock.wait_for_file(work / "bootstrap.up", "waiting for prefill rank 0's bootstrap server")
    kv, aux = kv_buffers(scenario, "prefill", args.rank, stage=args.stage), aux_buffers("prefill")
    # the manager registers this rank with the bootstrap server (register_to_bootstrap) as it is built
    kv_args = build_kv_args(scenario, "prefill", args.rank, sa, kv, aux, args.stage)
    mgr = make_manager(scenario, "prefill", args.mode, sa, kv_args)
    calls = count_kvwire_sends(mgr) if args.mode == "kvwire" else None
    sender_cls = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER)
    servers = range(scenario.decode_servers)
    senders = {
        (rep, s): sender_cls(
            mgr=mgr, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=scenario.room(args.room, rep, s)
        )
        for rep in range(scenario.repeats)
        for s in servers
    }
    (work / f"{me.name}.ready").touch()

    # as PrefillBootstrapQueue: wait for the decodes' metadata, then init; then send the pages
    requests: list[dict[str, Any]] = []
    for rep in range(scenario.repeats):
        waiting = {
            s: clock.poll_until(
                senders[rep, s].poll,
                {KVPoll.WaitingForInput, KVPoll.Failed},
                f"prefill bootstrap (decode server {s}, repetition {rep})",
            )
            for s in servers
        }
        if rep == scenario.killed_at_rep:
            (work / f"{me.name}.waiting").touch()
            for victim in scenario.killed():
                clock.wait_for_file(work / f"{victim.name}.killed", f"waiting for {victim.name} to be killed")
        started: dict[int, float] = {}
        for s in servers:
            if waiting[s] == KVPoll.WaitingForInput:
                pages = scenario.src_pages_of(s)
                senders[rep, s].init(len(pages), aux_index=AUX_INDEX)
                started[s] = time.perf_counter()
                senders[rep, s].send(np.asarray(pages, dtype=np.int32))
        concluded = clock.poll_all_timed(
            {s: senders[rep, s].poll for s in started}, {KVPoll.Success, KVPoll.Failed}, f"prefill transfer {rep}"
        )
        for s in servers:
            state, at = concluded.get(s, (waiting[s], None))
            requests.append(
                {
                    "server": s,
                    "rep": rep,
                    "kvpoll": kvpoll_name(state),
                    "failure": failure_reason(senders[rep, s]) if state == KVPoll.Failed else None,
                    # from send() to the concluded state, as polled (None: never sent)
                    "seconds": None if at is None else round(at - started[s], 6),
                }
            )
    states = [r["kvpoll"] for r in requests]
    failures = [r["failure"] for r in requests if r["failure"]]
    result: dict[str, Any] = {
        "manager": f"{type(mgr).__module__}.{type(mgr).__qualname__}",
        "kvwire_layout": layout_labels(mgr),
        "attn_tp": [mgr.attn_tp_size, mgr.attn_tp_rank],
        "pp": [mgr.pp_size, mgr.pp_rank],
        "heads": list(scenario.heads_of(scenario.prefill_tp, args.rank)),
        "kvpoll": common_state(states),
        "failure": failures[0] if failures else None,
        "requests": requests,
        "failed_sessions": sorted(mgr.failed_sessions),
    }
    if calls is not None:
        result["kvwire_backend"] = mgr.kvwire_connection.name
        result["kvwire_sends"] = len(calls)
        result["kvwire_calls"] = calls if len(calls) <= 20 else [*calls[:20], {"more": len(calls) - 20}]
    for p in scenario.processes():
        if p.role == "decode":
            while not ((work / f"{p.name}.done").exists() or (work / f"{p.name}.killed").exists()):
                clock.check(f"waiting for {p.name} to verify")
                time.sleep(0.05)
    if server is not None:
        server.close()
    return result


def compare_pages(
    scenario: Scenario,
    rank: int,
    kv: Sequence[Any],
    before: Sequence[Any],
    want: Sequence[Any],
    pairs: Sequence[tuple[int, int]],
    label: str = "",
    device_pairs: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """Token by token and head by head: each destination page holds its source page's heads of this rank.

    ``want`` are the prefill server's buffers with every head; this decode rank's
    heads of them (:meth:`Scenario.heads_of`) are what it must hold. Decode buffer ``b``
    is filled from the prefill buffer :meth:`Scenario.sources` names, at ``pairs``
    (``device_pairs`` for a HiSparse decode's device buffers); a buffer no prefill
    buffer fills (a draft the prefill lacks) must not change at all. Every page not
    written (guard pages included) must be byte-equal to ``before``.
    """
    import torch

    heads = scenario.heads_of(scenario.decode_tp, rank)
    pool = scenario.decode_pages
    mismatches: list[str] = []
    mismatch_count = checked = unchanged = 0
    changed: list[str] = []
    for b, ((source, device), now, old) in enumerate(zip(scenario.sources(), kv, before, strict=True)):
        these = [] if source is None else list(device_pairs if device else pairs)
        written = sorted({d for _, d in these})
        now_b, old_b = head_bytes_view(now), head_bytes_view(old)
        if these:
            assert source is not None
            src = want[source]
            src_b = head_bytes_view(src[:, :, heads.start : heads.stop, :] if not scenario.mla else src)
            src_idx = torch.tensor([s for s, _ in these], dtype=torch.long)
            dst_idx = torch.tensor([d for _, d in these], dtype=torch.long)
            equal = (now_b[dst_idx] == src_b[src_idx]).all(dim=-1)  # [pair, token, head]
            bad = (~equal).nonzero().tolist()
            mismatch_count += len(bad)
            checked += len(these)
            for i, t, h in bad[: max(0, MISMATCH_LIMIT - len(mismatches))]:
                head = "latent" if scenario.mla else f"head {heads[h]}"
                s, d = these[i]
                where = "device page" if device else "page"
                mismatches.append(f"{label}buffer {b} {where} {d} token {t} {head} != prefill buffer {source} page {s}")
        differs = (now_b != old_b).reshape(now_b.shape[0], -1).any(dim=1)
        differs[written] = False
        for p in differs.nonzero().flatten().tolist():
            changed.append(f"{label}buffer {b} {'guard ' if p >= pool else ''}page {p}")
        unchanged += pool + GUARD_PAGES - len(written)
    tokens, nheads = scenario.page_size, len(heads)
    return {
        "pages_checked": checked,
        "head_slices_checked": checked * tokens * nheads,
        "mismatches": mismatches,
        "mismatch_count": mismatch_count,
        "other_pages_changed": changed,
        "pages_compared_unchanged": unchanged,
    }


def run_decode(args: argparse.Namespace, scenario: Scenario, clock: Clock) -> dict[str, Any]:
    """One decode TP rank of decode server ``--server``: a receiver per request, then a byte-exact check of its pool."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    work = Path(args.workdir)
    me = scenario.proc("decode", args.server, args.rank)
    sa = publish_server_args(scenario, "decode", args.rank, args.bootstrap_port)
    kv, aux = kv_buffers(scenario, "decode", args.rank, args.server), aux_buffers("decode")
    before = [t.clone() for t in kv]
    mgr = make_manager(scenario, "decode", args.mode, sa, build_kv_args(scenario, "decode", args.rank, sa, kv, aux))
    for p in scenario.processes():
        if p.role == "prefill":
            clock.wait_for_file(work / f"{p.name}.ready", f"waiting for {p.name} to start")
    addr = f"127.0.0.1:{args.bootstrap_port}"
    # 503 until every prefill rank registered: then the prefill's attn_tp_size is known
    while not mgr.try_ensure_parallel_info(addr):
        clock.check(f"fetching the prefill's parallel info from {addr}")
        time.sleep(0.2)
    info = mgr.prefill_info_table[addr]

    want = global_kv_buffers(scenario, "prefill")
    pairs = list(zip(scenario.src_pages_of(args.server), scenario.dst_pages))
    device_pairs = list(zip(scenario.src_pages_of(args.server), scenario.device_dst_pages))
    dst = np.asarray(scenario.dst_pages, dtype=np.int32)
    # decode.py (HiSparse with a device-only draft): the logical device pages beside the host pages
    device_dst = np.asarray(scenario.device_dst_pages, dtype=np.int32) if scenario.hisparse else None
    receiver_cls = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)
    states: list[str] = []
    reasons: list[str] = []
    totals: dict[str, Any] = {}
    for rep in range(scenario.repeats):
        if rep:  # so that what the previous request wrote cannot pass for this one (random bytes are never 0)
            for t in (*kv, *before):
                t[list(scenario.dst_pages)] = 0
                t[list(scenario.device_dst_pages)] = 0
        receiver = receiver_cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=scenario.room(args.room, rep, args.server))
        receiver.init(0)
        state = clock.poll_until(receiver.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, f"decode bootstrap {rep}")
        if state == KVPoll.WaitingForInput:
            receiver.send_metadata(dst, aux_index=AUX_INDEX, device_kv_indices=device_dst)
            if args.server == scenario.killed_decode and rep == scenario.killed_at_rep:
                (work / f"{me.name}.metadata_sent").touch()
                while True:  # the driver SIGKILLs this process now
                    clock.check("waiting to be killed after sending the metadata")
                    time.sleep(0.05)
            state = clock.poll_until(receiver.poll, {KVPoll.Success, KVPoll.Failed}, f"decode transfer {rep}")
        states.append(kvpoll_name(state))
        if state == KVPoll.Failed:
            reasons.append(failure_reason(receiver) or "")
        # byte-exact check of every KV buffer, guard pages included: after Success the destination pages
        # hold this rank's heads of the source pages and nothing else changed; after Failed nothing changed
        label = f"request {rep}: " if scenario.repeats > 1 else ""
        ok = state == KVPoll.Success
        got = compare_pages(
            scenario, args.rank, kv, before, want, pairs if ok else [], label, device_pairs if ok else []
        )
        for key, value in got.items():  # summed over the requests (the last one's count of unchanged pages)
            keep = key == "pages_compared_unchanged"
            totals[key] = value if keep else totals.get(key, [] if isinstance(value, list) else 0) + value
    result = {
        "manager": f"{type(mgr).__module__}.{type(mgr).__qualname__}",
        "kvwire_layout": layout_labels(mgr),
        "attn_tp": [mgr.attn_tp_size, mgr.attn_tp_rank],
        "prefill_attn_tp_size": info.attn_tp_size,  # what the bootstrap server told this rank
        "target_tp_ranks": list(info.target_tp_ranks),
        "heads": list(scenario.heads_of(scenario.decode_tp, args.rank)),
        "kvpoll": common_state(states),
        "failure": reasons[0] if reasons else None,
        **totals,
    }
    result["mismatches"] = result["mismatches"][:MISMATCH_LIMIT]
    result["other_pages_changed"] = result["other_pages_changed"][:MISMATCH_LIMIT]
    (work / f"{me.name}.done").touch()
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
    p.add_argument("--room", type=int, required=True, help="the first request's bootstrap room")
    p.add_argument("--workdir", required=True)
    p.add_argument("--timeout-s", type=float, default=90.0)
    p.add_argument("--rank", type=int, default=0, help="this process's TP rank in its server")
    p.add_argument("--server", type=int, default=0, help="the decode server this rank belongs to")
    p.add_argument("--stage", type=int, default=0, help="this prefill rank's pipeline stage")
    args = p.parse_args()
    deadline = time.monotonic() + args.timeout_s
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scenario = SCENARIOS[args.scenario]
    me = scenario.proc(args.role, args.server, args.rank, args.stage)
    work = Path(args.workdir)
    out = work / f"{me.name}.json"
    started = time.monotonic()
    result: dict[str, Any] = {"role": args.role, "name": me.name, "scenario": args.scenario, "mode": args.mode}
    try:
        if args.mode == "kvwire":
            assert os.environ.get("SGLANG_PLUGINS") == "kvwire", "kvwire mode needs SGLANG_PLUGINS=kvwire"
            from sglang.srt.plugins import load_plugins

            load_plugins()  # as sglang's scheduler process does, before any manager is built
        run = run_prefill if args.role == "prefill" else run_decode
        peers = [q.name for q in scenario.processes() if q != me]
        result.update(run(args, scenario, Clock(deadline, work, peers)))
        result["ok"] = True
    except BaseException as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    result["seconds"] = round(time.monotonic() - started, 2)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.rename(out)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
    if args.role == "decode" and not (work / f"{me.name}.done").exists():
        (work / f"{me.name}.done").touch()  # let the prefill go even when the decode broke
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
