"""Codec registry: ``--codec name:key=value,...`` strings from the CLI and the shim map to codec instances."""

from __future__ import annotations

from collections.abc import Callable

from dgt.codecs.base import Codec

_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register(name: str) -> Callable[[Callable[..., Codec]], Callable[..., Codec]]:
    """Class decorator: make a codec constructible by name."""

    def deco(factory: Callable[..., Codec]) -> Callable[..., Codec]:
        _REGISTRY[name] = factory
        return factory

    return deco


def _parse_value(text: str) -> object:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"slimdp:alpha=0.3,eps=0.15"`` -> ``("slimdp", {"alpha": 0.3, "eps": 0.15})``."""
    name, _, args = spec.partition(":")
    kwargs: dict[str, object] = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"codec option {item!r} in {spec!r} is not key=value")
        kwargs[key.strip()] = _parse_value(value.strip())
    return name.strip(), kwargs


def make_codec(spec: str | Codec) -> Codec:
    """Build a codec from a registry spec (or pass an instance through)."""
    if isinstance(spec, Codec):
        return spec
    _load_builtin()
    name, kwargs = parse_spec(spec)
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    """Import the codec modules so their @register decorators run (modules missing so far are skipped)."""
    import importlib

    for mod in ("dense", "dgt", "slimdp", "qsgd", "olandraj", "decentralized", "lgc", "lowrank"):
        try:
            importlib.import_module(f"dgt.codecs.{mod}")
        except ModuleNotFoundError as exc:  # a codec module not written yet
            if exc.name != f"dgt.codecs.{mod}":
                raise
