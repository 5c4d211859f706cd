"""Find a backend class by name: built-ins plus the ``servelab.backends`` entry-point group.

A third party adds a backend without forking by declaring, in its own package::

    [project.entry-points."servelab.backends"]
    mybackend = "mypkg.backend:MyBackend"

Built-in backends are found one way only: every ``Backend`` subclass with its own ``name`` in the
modules of ``_BUILTIN_MODULES``, imported on first lookup (the project declares no entry points of its own).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from backends.base import Backend
from backends.profile import REFERENCE_PROFILE, ServerProfile, profile_of

ENTRY_POINT_GROUP = "servelab.backends"
_BUILTIN_MODULES = (
    "backends.openai",
    "backends.llamacpp",
    "backends.vllm",
    "backends.tgi",
    "backends.sglang",
)
_registry: dict[str, type[Backend]] = {}
_loaded = False


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for mod in _BUILTIN_MODULES:
        module = importlib.import_module(mod)
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, Backend)
                and obj.__module__ == mod
                and "name" in vars(obj)
            ):
                _registry.setdefault(obj.name, obj)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"entry point {ep.name!r} ({ep.value}) is not a backends.base.Backend subclass")
        _registry.setdefault(ep.name, cls)
    _loaded = True


def get_backend(name: str) -> type[Backend]:
    _load()
    try:
        return _registry[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; available: {', '.join(sorted(_registry))}") from None


def available() -> list[str]:
    _load()
    return sorted(_registry)


def server_profiles() -> list[ServerProfile]:
    """Every known server's profile: the bundled reference server's and each registered backend's."""
    _load()
    return list(dict.fromkeys([REFERENCE_PROFILE, *(profile_of(cls) for cls in _registry.values())]))
