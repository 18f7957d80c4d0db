"""The connector API of the installed vLLM (0.33.0), as ``inspect`` sees it: what a kvwire connector must implement.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/probe_signatures.py [--json]

Prints, for ``KVConnectorBase_V1``, every method and property with its signature and whether it is abstract;
the members of ``KVConnectorRole``; the metadata base classes; and the dataclass fields of ``KVCacheConfig``,
``KVCacheTensor``, ``KVCacheGroupSpec``, ``FullAttentionSpec``, ``KVConnectorOutput``,
``KVConnectorTransferResults`` and ``KVTransferConfig``. Plain text by default (pasted into README.md),
JSON with ``--json``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.outputs import KVConnectorOutput


def _sig(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(?)"


def methods(cls: type) -> list[dict]:
    abstract = getattr(cls, "__abstractmethods__", frozenset())
    rows = []
    for name, raw in cls.__dict__.items():
        if (name.startswith("__") and name != "__init__") or name == "_abc_impl":
            continue
        kind = "method"
        target = raw
        if isinstance(raw, classmethod):
            kind, target = "classmethod", raw.__func__
        elif isinstance(raw, staticmethod):
            kind, target = "staticmethod", raw.__func__
        elif isinstance(raw, property):
            kind, target = "property", raw.fget
        elif not callable(raw):
            rows.append({"name": name, "kind": "attribute", "value": repr(raw)})
            continue
        rows.append({"name": name, "kind": kind, "abstract": name in abstract, "signature": _sig(target)})
    return rows


def fields(cls: type) -> list[str]:
    return [
        f"{f.name}: {f.type if isinstance(f.type, str) else getattr(f.type, '__name__', f.type)}"
        + ("" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING else " = <default>")
        for f in dataclasses.fields(cls)
    ]


def collect() -> dict:
    return {
        "vllm": vllm.__version__,
        "KVConnectorBase_V1": methods(base.KVConnectorBase_V1),
        "KVConnectorBase_V1.__abstractmethods__": sorted(base.KVConnectorBase_V1.__abstractmethods__),
        "SupportsHMA": methods(base.SupportsHMA),
        "KVConnectorRole": {m.name: m.value for m in base.KVConnectorRole},
        "KVConnectorMetadata": {
            "bases": [b.__name__ for b in base.KVConnectorMetadata.__mro__],
            "abstract": sorted(base.KVConnectorMetadata.__abstractmethods__),
        },
        "KVConnectorHandshakeMetadata": {"bases": [b.__name__ for b in base.KVConnectorHandshakeMetadata.__mro__]},
        "KVConnectorWorkerMetadata": methods(base.KVConnectorWorkerMetadata),
        "KVConnectorTransferResults": fields(base.KVConnectorTransferResults),
        "KVConnectorOutput": fields(KVConnectorOutput),
        "KVCacheConfig": fields(kci.KVCacheConfig),
        "KVCacheTensor": fields(kci.KVCacheTensor),
        "KVCacheGroupSpec": fields(kci.KVCacheGroupSpec),
        "FullAttentionSpec": fields(kci.FullAttentionSpec),
        "KVTransferConfig": fields(KVTransferConfig),
        "KVConnectorFactory.create_connector": _sig(KVConnectorFactory.create_connector),
        "KVConnectorFactory.get_connector_class": _sig(KVConnectorFactory.get_connector_class),
    }


def main() -> None:
    data = collect()
    if "--json" in sys.argv:
        print(json.dumps(data))
        return
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{key}:")
            for row in value:
                if row["kind"] == "attribute":
                    print(f"    {row['name']} = {row['value']}")
                else:
                    tag = "  [abstract]" if row.get("abstract") else ""
                    deco = "" if row["kind"] == "method" else f"@{row['kind']} "
                    print(f"    {deco}{row['name']}{row['signature']}{tag}")
        elif isinstance(value, list):
            print(f"{key}:")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
