"""One side of a vLLM prefill/decode pair on CPU, driven by a test over JSON lines (stdin -> stdout).

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/pd_node.py

What runs is vLLM 0.33.0's own code, except the model: a ``VllmConfig`` with a tiny local Llama config, or a
tiny DeepSeek-V2 one (MLA) (no weights), vLLM's v1 ``Scheduler`` (which creates the SCHEDULER-role connector
through ``KVConnectorFactory``), world-size-1 gloo groups, ``ensure_kv_transfer_initialized`` (the WORKER-role
connector, through the factory), the KV cache built as the engine core builds it for the named attention
backend (:mod:`engine_kv`: vLLM resolves the layout from the backend's supported layouts and the connector's
``get_required_kvcache_layout``; nothing here sets one), and each step's worker hooks through the model runner's own
``KVConnectorModelRunnerMixin._get_kv_connector_output`` (bind, start_load_kv, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors, clear), or ``kv_connector_no_forward`` when nothing is
scheduled. The "forward" of a prefill writes seeded random bytes into the scheduled request's blocks of every
layer; a decode's writes nothing. Commands (kvwire.control.serve):

  start   {role: prefill|decode, connector, module, extra, filler_tokens, num_blocks, layers, heads, head_size,
           mla, attn_backend, tp_size, tp_rank, dist_port}
          -> num_blocks, pid, the attention backend, its supported layouts, the layout vLLM resolved, the KV
             tensors' shape and strides, kernel blocks per block
          (one node per TP rank: tp_size nodes start together on dist_port, each with its own Scheduler and
           max(1, heads // tp_size) KV heads)
  prefill {req_id, n_tokens, seed}            -> kv_transfer_params, block ids, per-block digests, t_finished
  decode  {req_id, n_tokens, params, timeout_s, check_untouched}
                                              -> block ids, digests, t_finished_recving, invalid blocks, status
  step_until_sent {req_id, timeout_s}         -> when finished_sending reported it (its blocks freed)
  digests {block_ids}                         -> per-block digests of this side's KV cache
  head_digests {block_ids}                    -> per-block, per-KV-head digests of this side's KV cache
  metrics {prefix, steps}                     -> the Prometheus samples vLLM's KVConnectorProm recorded from the
                                                 connector's stats, and vLLM's KVConnectorLogging summary
vLLM's logging goes to stderr: stdout carries only the replies.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvwire.control import claim_stdout

REPLIES = claim_stdout()  # vLLM logs to stdout: the replies keep the real one, the rest goes to stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_MODULES", "^efa")
sys.path.insert(0, str(Path(__file__).parent))

import probe_scheduler  # noqa: E402  (next to this script: sys.path[0])
import torch  # noqa: E402
from engine_kv import TINY_DEEPSEEK, engine_kv_caches  # noqa: E402
from releases import engine_request  # noqa: E402
from vllm.config import (  # noqa: E402
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: E402
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from kvwire.control import serve  # noqa: E402

TINY_LLAMA = {**probe_scheduler.TINY_LLAMA, "max_position_embeddings": 65536}  # longer prompts than the probe's
BLOCK_SIZE, HEADS, HEAD_SIZE = 32, 2, 64  # a multiple of 32: the CPU backend's kernel block sizes, and NIXL's
STEP_PAUSE_S = 0.0002  # between engine steps, as an idle engine loop would poll


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """A prefill or decode engine: real Scheduler, real worker-side connector, real KV cache, no model."""

    def __init__(self, msg: dict[str, Any]) -> None:
        self.role = msg["role"]
        layers, heads, head_size = (
            int(msg.get("layers", 2)),
            int(msg.get("heads", HEADS)),
            int(msg.get("head_size", HEAD_SIZE)),
        )
        tp_size, tp_rank = int(msg.get("tp_size", 1)), int(msg.get("tp_rank", 0))
        num_blocks = int(msg.get("num_blocks", 64))
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        if msg.get("mla"):
            model = dict(TINY_DEEPSEEK, num_hidden_layers=layers, first_k_dense_replace=layers)
            name = f"kvwire-vllm-tiny-deepseek-{layers}"
        else:
            model = dict(TINY_LLAMA, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads)
            model.update(head_dim=head_size, hidden_size=heads * head_size)
            name = f"kvwire-vllm-tiny-llama-{layers}x{heads}x{head_size}"
        # one path for both sides: vLLM's NIXL handshake hashes the model name into its compatibility check
        self.model_dir = os.path.join(tempfile.gettempdir(), name)
        os.makedirs(self.model_dir, exist_ok=True)
        staged = Path(self.model_dir) / f"config.json.{os.getpid()}"
        staged.write_text(json.dumps(model))
        os.replace(staged, Path(self.model_dir) / "config.json")
        model_config = ModelConfig(  # vLLM keeps KV memory for one request of max_model_len tokens
            model=self.model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=(num_blocks - 1) * BLOCK_SIZE
        )
        self.config = VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
            kv_transfer_config=KVTransferConfig(
                kv_connector=msg.get("connector", "KvwireConnector"),
                kv_connector_module_path=msg.get("module", "kvwire.hosts.vllm"),
                kv_role="kv_producer" if self.role == "prefill" else "kv_consumer",
                kv_buffer_device="cpu",
                kv_connector_extra_config=msg.get("extra", {}),
            ),
        )
        self.config.cache_config.block_size = BLOCK_SIZE
        # one step prefills a whole prompt: the stand-in "forward" writes a request's blocks when it is first
        # scheduled, and samples a token for every scheduled request (vLLM's runner gives none for a partial
        # prefill), so a prompt chunked at 2,048 tokens would finish after its first chunk
        scheduler_config = self.config.scheduler_config
        scheduler_config.max_num_batched_tokens = max(
            scheduler_config.max_num_batched_tokens, model_config.max_model_len
        )
        self._ctx = set_current_vllm_config(self.config)
        self._ctx.__enter__()
        # the engine core's order: resolve the layout, plan the KV cache, allocate it (the model runner's)
        self.engine_kv = engine_kv_caches(
            self.config, str(msg.get("attn_backend", "FLASH_ATTN")), list(self.layers), num_blocks
        )
        self.kvc = self.engine_kv.kv_cache_config
        dist = f"tcp://127.0.0.1:{int(msg.get('dist_port') or _free_port())}"
        init_distributed_environment(tp_size, tp_rank, dist, tp_rank, backend="gloo")
        initialize_model_parallel(tp_size, 1)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kvc,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK_SIZE,
            log_stats=True,  # the connector's stats reach vLLM's logging and Prometheus classes (below)
        )
        # vLLM's own stat-logger parts for a connector: PrometheusStatLogger's and LoggingStatLogger's
        self.kv_prom = KVConnectorProm(self.config, ["model_name", "engine"], {0: [self.model_dir, "0"]})
        self.kv_logging = KVConnectorLogging(self.config.kv_transfer_config)
        self.allocated: dict[str, list[int]] = {}  # the blocks vLLM gave each request, as the connector heard
        allocated = self.scheduler.connector.update_state_after_alloc

        def noting_blocks(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            self.allocated[request.request_id] = list(blocks.get_block_ids()[0])
            return allocated(request, blocks, num_external_tokens)

        # a failed load can end the request (and free its blocks) within the very step that allocated them
        self.scheduler.connector.update_state_after_alloc = noting_blocks
        ensure_kv_transfer_initialized(self.config, self.kvc)
        self.worker = get_kv_transfer_group()
        self.kv_caches = self.engine_kv.kv_caches
        first = next(iter(self.kv_caches.values()))
        self.split = first.shape[0] // self.kvc.num_blocks  # kernel blocks per block (the backend's kernels)
        self.worker.register_kv_caches(self.kv_caches)
        handshake = self.worker.get_handshake_metadata()
        if handshake is not None:  # vLLM's NIXL connectors: the engine core hands it to the scheduler side
            self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.sent: set[str] = set()
        self.recved: dict[str, float] = {}
        self.invalid: set[int] = set()
        self.finished_at: dict[str, float] = {}
        self.finish_reasons: dict[str, str] = {}
        self.params: dict[str, Any] = {}
        self.seeds: dict[str, int] = {}
        self.block_digests: dict[tuple[str, int], str] = {}
        filler = int(msg.get("filler_tokens", 0))
        if filler:  # a local request holding blocks, so the remote request's block ids differ from the prefill's
            self.scheduler.add_request(self._request("filler", filler, None, max_tokens=4000))
            self.step()

    # -- the engine loop -------------------------------------------------------

    def _request(self, req_id: str, n: int, params: dict[str, Any] | None, max_tokens: int) -> Request:
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        return engine_request(req_id, n, sp, BLOCK_SIZE)

    def block(self, layer: str, b: int) -> torch.Tensor:
        """Block ``b`` (vLLM's block id) of ``layer``: its kernel blocks, one contiguous run."""
        return self.kv_caches[layer][b * self.split : (b + 1) * self.split]

    def _forward(self, out: Any) -> None:
        """The model's KV writes: seeded random bytes into each newly scheduled prefill request's blocks."""
        for new in out.scheduled_new_reqs:
            seed = self.seeds.get(new.req_id)
            if seed is None:
                continue
            gen = torch.Generator().manual_seed(seed)
            for layer in self.layers:
                for b in new.block_ids[0]:
                    page = self.block(layer, b).view(torch.int16)
                    page.copy_(torch.randint(-32768, 32767, page.shape, generator=gen, dtype=torch.int16))
            # hashed here, inside the forward: before request_finished, outside the timed span
            blocks = list(new.block_ids[0])
            hashed = self.digests(blocks)
            self.block_digests.update(
                {(layer, b): hashed[layer][i] for layer in self.layers for i, b in enumerate(blocks)}
            )

    def step(self) -> None:
        out = self.scheduler.schedule()
        if out.total_num_scheduled_tokens == 0:
            mro = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config)
        else:
            with (
                set_forward_context(None, self.config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out,
            ):
                self._forward(out)
            ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
            mro = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=kv_out,
            )
        now = time.monotonic()
        kv = mro.kv_connector_output
        if kv is not None:
            self.sent |= set(kv.finished_sending or ())
            for r in kv.finished_recving or ():
                self.recved.setdefault(r, now)
            self.invalid |= set(kv.invalid_block_ids or ())
        engine_outputs = self.scheduler.update_from_output(out, mro)
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:  # what vLLM's stat loggers record
                self.kv_prom.observe(stats.kv_connector_stats, 0)
                self.kv_logging.observe(stats.kv_connector_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished_at.setdefault(o.request_id, now)
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
                    if o.kv_transfer_params:
                        self.params[o.request_id] = o.kv_transfer_params

    def step_until(self, done: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(STEP_PAUSE_S)
        return True

    # -- commands ----------------------------------------------------------------

    def digests(self, block_ids: list[int]) -> dict[str, list[str]]:
        """Per layer, the sha256 of each block's bytes (in ``block_ids`` order)."""
        return {
            layer: [
                hashlib.sha256(self.block(layer, b).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for b in block_ids
            ]
            for layer in self.layers
        }

    def head_digests(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Per layer, per block of ``block_ids``, the sha256 of each KV head's K|V of every token."""
        return {
            "digests": {
                layer: [
                    [
                        hashlib.sha256(head.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                        for head in self.block(layer, b).transpose(0, 1)
                    ]
                    for b in msg["block_ids"]
                ]
                for layer in self.layers
            }
        }

    def prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        req_id = msg["req_id"]
        self.seeds[req_id] = int(msg.get("seed", 1))
        self.scheduler.add_request(self._request(req_id, int(msg["n_tokens"]), {"do_remote_decode": True}, 1))
        if not self.step_until(lambda: req_id in self.params, float(msg.get("timeout_s", 30))):
            raise RuntimeError(f"prefill {req_id} did not finish")
        params = self.params[req_id]
        self.step()  # the step whose metadata tells the worker the blocks are ready
        ids = params.get("remote_block_ids")
        flat = ids[0] if ids and isinstance(ids[0], (list, tuple)) else ids
        return {
            "params": params,
            "block_ids": list(flat),
            "digests": {layer: [self.block_digests[layer, b] for b in flat] for layer in self.layers},
            "t_finished": self.finished_at[req_id],
        }

    def decode(self, msg: dict[str, Any]) -> dict[str, Any]:
        req_id = msg["req_id"]
        self.invalid = set()  # what get_block_ids_with_load_errors reports from here on
        self.scheduler.add_request(self._request(req_id, int(msg["n_tokens"]), dict(msg["params"]), 2))
        self.step()  # get_num_new_matched_tokens, update_state_after_alloc: the blocks are allocated
        block_ids = self.allocated.get(req_id) or list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        before = self.digests(block_ids) if msg.get("check_untouched", True) else None
        ok = self.step_until(lambda: req_id in self.recved, float(msg.get("timeout_s", 30)))
        t_recv = self.recved.get(req_id)
        after = self.digests(block_ids)
        self.step()  # the request is scheduled (or failed) with what arrived
        request = self.scheduler.requests.get(req_id)
        side = getattr(self.worker, "worker_side", None)
        receiver = getattr(side, "receiver", None)
        return {
            "finished_recving": ok,
            "t_finished_recving": t_recv,
            "block_ids": block_ids,
            "digests_before": before,
            "digests": after,
            "invalid_block_ids": sorted(self.invalid),
            "status": str(request.status) if request is not None else "gone",
            "finish_reason": self.finish_reasons.get(req_id),
            "failures": {r: why for r, why in (getattr(receiver, "failures", {}) or {}).items() if r == req_id},
        }

    def step_until_sent(self, msg: dict[str, Any]) -> dict[str, Any]:
        req_id = msg["req_id"]
        ok = self.step_until(lambda: req_id in self.sent, float(msg.get("timeout_s", 30)))
        side = getattr(self.worker, "worker_side", None)
        sender = getattr(side, "sender", None)
        return {
            "sent": ok,
            "in_requests": req_id in self.scheduler.requests,
            "free_blocks": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "failures": list(getattr(sender, "failures", []) or []),
        }

    def metrics(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The ``vllm:`` Prometheus samples whose name starts with ``msg["prefix"]``, and vLLM's log summary.

        The summary is what vLLM's ``KVConnectorLogging`` prints for the interval since the last call. First
        ``msg["steps"]`` engine steps (default 1), as an engine's loop takes: a connector's stats travel
        with a step's output.
        """
        import prometheus_client

        for _ in range(int(msg.get("steps", 1))):
            self.step()

        samples = {
            f"{sample.name}{sorted(sample.labels.items())}": sample.value
            for family in prometheus_client.REGISTRY.collect()
            for sample in family.samples
            if sample.name.startswith(msg["prefix"]) and not sample.name.endswith("_created")
        }
        acc = self.kv_logging.transfer_stats_accumulator
        summary = acc.reduce() if acc is not None and not acc.is_empty() else {}
        self.kv_logging.reset()
        return {"samples": samples, "summary": summary}

    def close(self) -> None:
        ensure_kv_transfer_shutdown()


def main() -> None:
    node: Node | None = None

    def start(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal node
        node = Node(msg)
        first = next(iter(node.kv_caches.values()))
        return {
            "ok": True,
            "num_blocks": node.kvc.num_blocks,
            "pid": os.getpid(),
            "attn_backend": node.engine_kv.backend,
            "supported_layouts": node.engine_kv.supported,
            "layout": node.engine_kv.layout,
            "kv_shape": list(first.shape),
            "kv_stride": list(first.stride()),
            "split": node.split,
            "use_mla": bool(node.config.model_config.use_mla),
        }

    def call(name: str) -> Any:
        def run(msg: dict[str, Any]) -> dict[str, Any]:
            assert node is not None, "send 'start' first"
            result: dict[str, Any] = getattr(node, name)(msg)
            return result

        return run

    def digests(msg: dict[str, Any]) -> dict[str, Any]:
        assert node is not None
        return {"digests": node.digests(list(msg["block_ids"]))}

    try:
        serve(
            {
                "start": start,
                "prefill": call("prefill"),
                "decode": call("decode"),
                "step_until_sent": call("step_until_sent"),
                "digests": digests,
                "head_digests": call("head_digests"),
                "metrics": call("metrics"),
            },
            stdout=REPLIES,
        )
    finally:
        if node is not None:
            node.close()


if __name__ == "__main__":
    main()
