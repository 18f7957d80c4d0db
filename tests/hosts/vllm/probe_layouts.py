"""kvwire's connector on the KV layouts vLLM 0.33.0 resolves, for every attention backend class that imports here.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/probe_layouts.py   (one JSON object on stdout)

For each backend in ``AttentionBackendEnum`` whose class imports on this CPU machine (FlashInfer and CUDA-only
ones do not), except sparse MLA (whose models add an indexer cache) and the ones no block size of 32 or 64
serves: a prefill engine and a decode engine, each a ``VllmConfig`` of a tiny local model (Llama, or
DeepSeek-V2 for an MLA backend) with ``KvwireConnector`` (backend ``local``: both engines in this process),
their KV caches built the way the engine core builds them (:func:`engine_kv.engine_kv_caches`: vLLM's
``resolve_kv_cache_layout`` with the backend's supported layouts and the connector's
``get_required_kvcache_layout``, ``get_kv_cache_configs``, ``allocate_kv_cache``; nothing sets a layout),
both roles of the connector made by ``KVConnectorFactory`` (the TP rank a worker reads from vLLM's parallel
state set per rank), and vLLM's ``Request`` / ``KVCacheBlocks`` in the scheduler hooks. A request's blocks
move from the prefill to the decode, equal TP sizes (1 -> 1) and across them (1 -> 2, 2 -> 1; MLA also),
and every byte is checked here: each decode block, head by head, against the prefill rank that must have
written it (the test's own routing), the decode's other blocks still zero. Reported per backend and pair:
the resolved layout, the tensors' shape and strides, what the decode finished with, its load errors, the
failure reason, and whether the bytes matched.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from kvwire.control import claim_stdout

REPLY = claim_stdout()  # vLLM logs to stdout: the reply keeps the real one
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/: ports

import torch  # noqa: E402
from engine_kv import TINY_DEEPSEEK, engine_kv_caches  # noqa: E402
from ports import free_port_run  # noqa: E402
from probe_scheduler import TINY_LLAMA  # noqa: E402
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS = 4  # the tiny Llama's: 2 per rank at TP 2
NUM_BLOCKS = 16
PAIRS = [(1, 1), (1, 2), (2, 1)]


def model_dir(mla: bool) -> str:
    if mla:
        model = dict(TINY_DEEPSEEK, num_hidden_layers=len(LAYERS), first_k_dense_replace=len(LAYERS))
    else:
        model = dict(TINY_LLAMA, num_hidden_layers=len(LAYERS), num_key_value_heads=KV_HEADS, num_attention_heads=8)
    path = Path(tempfile.mkdtemp(prefix="kvwire-probe-layouts-"))
    (path / "config.json").write_text(json.dumps(model))
    return str(path)


def engine_config(model: str, role: str, tp: int, block_size: int, port: int) -> VllmConfig:
    config = VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=(NUM_BLOCKS - 1) * block_size
        ),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector",
            kv_connector_module_path="kvwire.hosts.vllm",
            kv_role=role,  # type: ignore[arg-type]
            kv_connector_extra_config={"backend": "local", "side_channel_port": port, "load_timeout_s": 20},
        ),
    )
    config.cache_config.block_size = block_size
    return config


def as_rank(rank: int, size: int) -> None:
    """What vLLM's parallel state tells this process's next worker connector (one process per rank in vLLM)."""
    parallel_state.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[assignment]
    parallel_state.get_tensor_model_parallel_world_size = lambda: size  # type: ignore[assignment]


class Engine:
    """One engine: its config, its scheduler-side connector, and per TP rank its KV cache and worker connector."""

    def __init__(self, model: str, role: str, tp: int, backend: str, block_size: int, port: int) -> None:
        self.config = engine_config(model, role, tp, block_size, port)
        self.ranks = []
        for rank in range(tp):
            kv = engine_kv_caches(self.config, backend, LAYERS, NUM_BLOCKS)
            as_rank(rank, tp)
            worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv.kv_cache_config)
            worker.register_kv_caches(kv.kv_caches)
            self.ranks.append((kv, worker))
        self.kv = self.ranks[0][0]
        self.split = next(iter(self.kv.kv_caches.values())).shape[0] // self.kv.kv_cache_config.num_blocks
        self.scheduler = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.SCHEDULER, self.kv.kv_cache_config
        )

    def block(self, rank: int, layer: str, block: int) -> torch.Tensor:
        """vLLM's block ``block`` of ``layer`` on ``rank``: its kernel blocks, as [heads, ...] (one run)."""
        t = self.ranks[rank][0].kv_caches[layer]
        return t[block * self.split : (block + 1) * self.split].transpose(0, 1)

    def step(self) -> None:
        """One step's worker hooks, as the model runner calls them."""
        meta = self.scheduler.build_connector_meta(None)
        for _, worker in self.ranks:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()

    def close(self) -> None:
        for _, worker in self.ranks:
            worker.shutdown()


def request(req_id: str, n: int, params: dict[str, Any]) -> Request:
    return Request(
        req_id,
        [3 + i % 900 for i in range(n)],
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
        None,
    )


def held_heads(tp: int, rank: int, total: int) -> range:
    if total >= tp:
        return range(rank * (total // tp), (rank + 1) * (total // tp))
    return range(rank * total // tp, rank * total // tp + 1)


def move(backend: str, mla: bool, p_tp: int, d_tp: int, block_size: int) -> dict[str, Any]:
    model, port = model_dir(mla), free_port_run(p_tp)  # the prefill's side channel: port + rank
    prefill = Engine(model, "kv_producer", p_tp, backend, block_size, port)
    decode = Engine(model, "kv_consumer", d_tp, backend, block_size, port)
    try:
        first = next(iter(prefill.kv.kv_caches.values()))
        out: dict[str, Any] = {
            "backend": prefill.kv.backend,
            "supported": prefill.kv.supported,
            "layout": prefill.kv.layout,
            "decode_layout": decode.kv.layout,
            "shape": list(first.shape),
            "stride": list(first.stride()),
            "split": prefill.split,
        }
        p_blocks, d_blocks = [1, 2, 3], [7, 5, 6]
        gen = torch.Generator().manual_seed(p_tp * 10 + d_tp)
        for rank in range(p_tp):
            for layer in LAYERS:
                for b in p_blocks:
                    page = prefill.block(rank, layer, b).view(torch.int16)
                    page.copy_(torch.randint(-32768, 32767, page.shape, generator=gen, dtype=torch.int16))
        n = block_size * len(p_blocks) - 3
        req = request("p0", n, {"do_remote_decode": True})
        req.status = RequestStatus.FINISHED_STOPPED
        req.num_computed_tokens = n
        _, params = prefill.scheduler.request_finished(req, p_blocks)
        prefill.step()
        dreq = request("d0", n, dict(params or {}))
        out["matched"] = list(decode.scheduler.get_num_new_matched_tokens(dreq, 0))
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in d_blocks],))
        decode.scheduler.update_state_after_alloc(dreq, blocks, n)
        decode.step()
        finished: list[list[str]] = []
        errors: list[list[int]] = []
        deadline = time.monotonic() + 30
        for _, worker in decode.ranks:
            while True:
                got = worker.get_finished(set())[1]
                if got or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            finished.append(sorted(got or ()))
            errors.append(sorted(worker.get_block_ids_with_load_errors()))
        out["finished_recving"], out["load_errors"] = finished, errors
        out["failures"] = [dict(w.worker_side.receiver.failures) for _, w in decode.ranks]
        out["bytes_match"], out["untouched"] = check(prefill, decode, p_blocks, d_blocks, mla)
        return out
    finally:
        prefill.close()
        decode.close()


def check(prefill: Engine, decode: Engine, p_blocks: list[int], d_blocks: list[int], mla: bool) -> tuple[bool, bool]:
    """(every decode block holds what the prefill rank routed to it wrote, the decode's other blocks are zero)."""
    p_tp, d_tp = len(prefill.ranks), len(decode.ranks)
    match, untouched = True, True
    for d in range(d_tp):
        senders = [d * p_tp // d_tp] if p_tp <= d_tp else list(range(d * p_tp // d_tp, (d + 1) * p_tp // d_tp))
        for layer in LAYERS:
            for p_block, d_block in zip(p_blocks, d_blocks, strict=True):
                got = decode.block(d, layer, d_block).contiguous().view(torch.int16)
                if mla:  # the whole latent, from the first sender
                    match &= torch.equal(got, prefill.block(senders[0], layer, p_block).contiguous().view(torch.int16))
                    continue
                for j, head in enumerate(held_heads(d_tp, d, KV_HEADS)):
                    writer = min(s for s in senders if head in held_heads(p_tp, s, KV_HEADS))
                    local = head - held_heads(p_tp, writer, KV_HEADS).start
                    want = prefill.block(writer, layer, p_block)[local].contiguous().view(torch.int16)
                    match &= torch.equal(got[j], want)
            for b in set(range(1, NUM_BLOCKS)) - set(d_blocks):
                untouched &= not decode.block(d, layer, b).contiguous().view(torch.int16).any()
    return bool(match), bool(untouched)


def backends() -> dict[str, tuple[bool, int]]:
    """The backends that import here: name -> (MLA, the block size to run: 32, else 64)."""
    found: dict[str, tuple[bool, int]] = {}
    for member in AttentionBackendEnum:
        try:
            cls: Any = member.get_class()
        except Exception:
            continue
        if getattr(cls, "is_sparse", lambda: False)():
            continue
        mla = bool(getattr(cls, "is_mla", lambda: False)())
        for size in (32, 64):
            try:
                from vllm.v1.worker.utils import select_common_block_size

                if select_common_block_size(size, [cls]) > 0:
                    found[member.name] = (mla, size)
                    break
            except ValueError:
                continue
    return found


def main() -> None:
    result: dict[str, Any] = {"backends": {}}
    for name, (mla, size) in backends().items():
        entry: dict[str, Any] = {"mla": mla, "block_size": size}
        for p_tp, d_tp in PAIRS:
            try:
                entry[f"{p_tp}->{d_tp}"] = move(name, mla, p_tp, d_tp, size)
            except Exception as exc:
                entry[f"{p_tp}->{d_tp}"] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-1500:],
                }
        result["backends"][name] = entry
    REPLY.write(json.dumps(result) + "\n")
    REPLY.flush()


if __name__ == "__main__":
    main()
