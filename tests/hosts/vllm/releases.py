"""What differs between the supported vLLM releases, for the harness: one spelling that runs on each.

**KV-cache planning.** 0.33.0 moved the planning functions to ``vllm.v1.core.kv_cache_planning`` and has
the caller compute the global KV-cache groups (``get_global_kv_cache_groups``) before
``get_kv_cache_configs``; 0.32.0 keeps them in ``vllm.v1.core.kv_cache_utils`` and groups inside
``get_kv_cache_configs``. The arguments and results are
otherwise the same (read from both wheels), so the harness calls :func:`kv_cache_configs` on either.

**Requests.** :func:`engine_request` makes a ``Request`` as vLLM's engine core does when a KV connector is
configured, with the prefix-caching block hasher (vLLM's default ``sha256``): 0.32.0's block pool indexes a
full block's hash unconditionally (an ``IndexError`` for a request made without one), and with it the
scheduler's prefix cache runs as in a served engine. Its prompt is :func:`prompt`: requests of different
pairs share no block.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

try:
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_config_from_groups,
        get_kv_cache_configs,
    )

    def kv_cache_configs(config: Any, specs: list[dict[str, Any]], memory: list[int]) -> list[Any]:
        """vLLM's per-worker ``KVCacheConfig`` list for ``specs`` and ``memory`` bytes each."""
        result: list[Any] = get_kv_cache_configs(config, specs, memory, get_global_kv_cache_groups(config, specs))
        return result

except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # type: ignore[no-redef]
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as kv_cache_configs  # type: ignore[no-redef]

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

__all__ = ["engine_request", "get_kv_cache_config_from_groups", "kv_cache_configs", "prompt"]


def prompt(req_id: str, n: int) -> list[int]:
    """``n`` token ids (3..902) for request ``req_id``, drawn from a generator seeded by its key.

    The key of ``pN`` and ``dN`` (a prefill and its decode) is ``N``, so they share a prompt; any other
    request's is its id. Two keys' first blocks coincide with a chance of 900**-16 per pair: no test meets a
    prefix-cache hit it did not ask for.
    """
    key = req_id[1:] if req_id[:1] in ("p", "d") and req_id[1:].isdigit() else req_id
    draw = random.Random(zlib.crc32(key.encode()))
    return [3 + draw.randrange(900) for _ in range(n)]


def engine_request(req_id: str, n: int, sampling_params: SamplingParams, block_size: int) -> Request:
    """Request ``req_id`` of ``n`` prompt tokens, with vLLM's block hasher for ``block_size``-token blocks."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    return Request(req_id, prompt(req_id, n), sampling_params, None, block_hasher=hasher)
