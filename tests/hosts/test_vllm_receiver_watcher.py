"""A decode's arrivals never stop silently: a failed poll or an unreadable message is logged, and the next
request still arrives (found by bench/vllm_connector.py: after one failure every later request waited out
load_timeout_s while the prefill had written it).

Both sides of the connector in one process through the ``local`` backend, as test_vllm_compat.py does.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from test_vllm_compat import LAYERS, _blocks, _port, _request, _until, local_pair

from kvwire import TransferError
from kvwire.hosts.vllm import ConnectorSettings


def _move(p_sched: Any, d_sched: Any, p_work: Any, d_work: Any, name: str, src: list[int], dst: list[int]) -> None:
    prefill = _request(f"p-{name}", 70, {"do_remote_decode": True}, status="FINISHED_LENGTH_CAPPED")
    _, params = p_sched.request_finished(prefill, src)
    p_work.start(p_sched.build_connector_meta(None))
    decode = _request(f"d-{name}", 70, dict(params))
    assert d_sched.get_num_new_matched_tokens(decode, 0) == (70, True)
    d_sched.update_state_after_alloc(decode, _blocks(dst), 70)
    d_work.start(d_sched.build_connector_meta(None))
    assert _until(lambda: d_work.get_finished()[1]) == {f"d-{name}"}
    assert d_work.load_errors() == set()
    _until(lambda: p_work.get_finished()[0])


def test_a_failed_poll_is_logged_and_the_watcher_restarted(caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port(), "lease_s": 60})
    with local_pair(settings) as (p_sched, d_sched, p_work, d_work, p_caches, d_caches):
        connection = d_work.connection
        real_poll = connection.poll_notifications
        failed: list[int] = []

        def poll_failing_once() -> Any:
            if not failed:
                failed.append(1)
                raise TransferError("a transient poll failure")
            return real_poll()

        _move(p_sched, d_sched, p_work, d_work, "a", [1, 2], [4, 5])
        connection.poll_notifications = poll_failing_once  # the watcher's next poll raises, once
        _until(lambda: failed)
        with caplog.at_level(logging.ERROR, logger="kvwire"):
            _move(p_sched, d_sched, p_work, d_work, "b", [3], [6])
        for name in LAYERS:
            assert torch.equal(d_caches[name][[6]].view(torch.int16), p_caches[name][[3]].view(torch.int16))
        assert d_work.receiver.watcher_restarts == 1
        assert any(
            "notification watcher stopped (TransferError: a transient poll failure); restarting it" in r.getMessage()
            for r in caplog.records
        ), caplog.text
