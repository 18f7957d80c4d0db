"""The template's own tests; `pytest --kvwire-backend template` adds kvwire's contract suite to them."""

from __future__ import annotations

import kvwire
from kvwire.registry.findings import BackendOrigin
from kvwire_template.backend import TemplateBackend


def test_validates_against_the_spec() -> None:
    result = kvwire.validate_backend(TemplateBackend, BackendOrigin("template"))
    assert (result.status, result.findings) == ("ok", ())


def test_refuses_split_destinations_it_does_not_declare() -> None:
    assert "device_kv_indices" not in TemplateBackend.capabilities
