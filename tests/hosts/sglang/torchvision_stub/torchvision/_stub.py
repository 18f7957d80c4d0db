"""Placeholders: referencing them works, calling or instantiating them raises NotImplementedError."""


def stub(qualname: str) -> type:
    def _new(cls, *args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is not available: torchvision here is an inert stub (0.0.0+kvwire.stub) "
            "for kvwire's CPU-only sglang test venv"
        )

    return type(qualname.rsplit(".", 1)[-1], (), {"__new__": _new, "__module__": qualname.rsplit(".", 1)[0]})


def stubs(module: str, *names: str) -> dict:
    return {name: stub(f"{module}.{name}") for name in names}
