"""Decode side: register KV buffers, publish a kvwire.PeerDescription on stdout, verify what arrives.

Started by prefill.py, which reads the description from the pipe, then sends
pages with a notification, and writes one JSON line back: the destination
pages and their digest. This side waits for the notification (it arrives only
once the pages are in this process's memory), then checks them.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import kvwire

LAYERS, PAGES, PAGE_BYTES = 4, 256, 2048
CONFIG = kvwire.BackendConfig(process_settings=True)  # a standalone process: the engine's log lines are captured


def main(backend: str) -> int:
    bufs = [np.zeros((PAGES, PAGE_BYTES), np.uint8) for _ in range(2 * LAYERS)]  # K of each layer, then V
    layout = kvwire.KVLayout.mha(bufs[:LAYERS], bufs[LAYERS:])
    with kvwire.connect(backend, CONFIG, features={"interprocess", "notifications"}) as conn:
        conn.register_kv_buffers(layout)
        print(json.dumps(kvwire.PeerDescription(conn.endpoint(), layout).to_dict()), flush=True)
        arrived: list[np.ndarray] = []

        def on_arrival(arrival: kvwire.Arrival) -> None:  # on the watcher's thread, as soon as it is seen
            if arrival.notification.message == b"request-1":
                arrived.extend(buf.copy() for buf in bufs)  # the pages are here now: keep them as found

        with kvwire.NotificationWatcher(conn, on_arrival) as watcher:
            if watcher.wait_for(b"request-1", timeout_s=30) is None:
                print("decode: no notification within 30 s", file=sys.stderr)
                return 1
        sent = json.loads(sys.stdin.readline())  # what the prefill side sent, to check them against
        pages = np.array(sent["pages"], np.int64)
        digest = hashlib.blake2b(b"".join(buf[pages].tobytes() for buf in arrived)).hexdigest()
    ok = digest == sent["digest"]
    print(f"decode: {len(pages)} pages x {len(bufs)} buffers {'verified' if ok else 'DO NOT MATCH'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mooncake"))
