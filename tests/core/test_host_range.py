"""The host releases kvwire supports, and what an unsupported one does (kvwire.hosts.host_range)."""

from __future__ import annotations

import pytest

from kvwire import ConfigError
from kvwire.hosts.host_range import SUPPORTED, UnsupportedHostError, host_decision


def test_the_tested_releases_are_used() -> None:
    assert SUPPORTED == {"sglang": ("0.5.23",), "vllm": ("0.32.0", "0.33.0")}
    assert host_decision("sglang", "0.5.23", env={}) == "use"
    for release in ("0.32.0", "0.33.0"):
        assert host_decision("vllm", release, env={"KVWIRE_VLLM_UNSUPPORTED": "try"}) == "use"


def test_another_release_is_refused_naming_it_the_supported_ones_and_the_setting() -> None:
    with pytest.raises(UnsupportedHostError) as exc:
        host_decision("sglang", "0.5.22", env={})
    assert str(exc.value) == (
        "sglang 0.5.22 is not a release kvwire supports (tested: 0.5.23); install sglang==0.5.23, or set "
        "KVWIRE_SGLANG_UNSUPPORTED to fallback (run without kvwire) or try (use kvwire untested)"
    )
    assert isinstance(exc.value, ConfigError)
    with pytest.raises(UnsupportedHostError) as exc:
        host_decision("vllm", "0.31.0", env={})
    assert str(exc.value) == (
        "vllm 0.31.0 is not a release kvwire supports (tested: 0.32.0, 0.33.0); install vllm==0.33.0, or set "
        "KVWIRE_VLLM_UNSUPPORTED to try (use kvwire untested)"
    )


def test_the_operator_chooses_fallback_or_try_by_name() -> None:
    assert host_decision("sglang", "0.5.22", env={"KVWIRE_SGLANG_UNSUPPORTED": "fallback"}) == "fallback"
    assert host_decision("sglang", "0.5.22", env={"KVWIRE_SGLANG_UNSUPPORTED": " try "}) == "try"
    assert host_decision("vllm", "0.34.0", env={"KVWIRE_VLLM_UNSUPPORTED": "try"}) == "try"
    for host, value, choices in (("sglang", "yes", "fallback, try"), ("vllm", "fallback", "try")):
        var = f"KVWIRE_{host.upper()}_UNSUPPORTED"
        with pytest.raises(UnsupportedHostError) as exc:
            host_decision(host, "0.0.1", env={var: value})
        assert str(exc.value) == f"${var}={value!r} is not one of {choices}"


def test_a_host_not_installed_is_unsupported() -> None:
    with pytest.raises(UnsupportedHostError, match=r"^sglang not installed is not a release kvwire supports"):
        host_decision("sglang", "not installed", env={})
