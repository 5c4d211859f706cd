"""Reading one TOML table of a workload file: the one error type and the typed field checker.

Every problem is reported as a :class:`WorkloadError` naming the file, the key (dotted path, e.g.
``classes[1].prompt.mean``) and what was expected, so a user can fix the file without reading code.
"""

from __future__ import annotations

import math
from typing import Any


class WorkloadError(ValueError):
    """A workload file (or override) is invalid."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source, self.key = source, key
        super().__init__(f"{source}: key '{key}': {message}" if key else f"{source}: {message}")


def type_name(value: object) -> str:
    """The TOML name of a parsed value's type, for error messages."""
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)


class Table:
    """One TOML table being read: typed getters that report unknown and mistyped keys."""

    def __init__(self, data: object, source: str, path: str) -> None:
        if not isinstance(data, dict):
            raise WorkloadError(source, path, f"expected a table, got {type_name(data)} {data!r}")
        self.data, self.source, self.path = data, source, path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, message: str) -> WorkloadError:
        return WorkloadError(self.source, self.key(name), message)

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.data.get(name)

    def get(
        self, name: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False
    ) -> Any:
        value = self.raw(name)
        if value is None:
            if required:
                raise self.error(name, f"is required ({_expected(kind)})")
            return default
        if isinstance(value, bool) and bool not in _as_tuple(kind) or not isinstance(value, kind):
            raise self.error(name, f"expected {_expected(kind)}, got {type_name(value)} {value!r}")
        return float(value) if kind in (float, (int, float)) and not isinstance(value, bool) else value

    def number(self, name: str, default: float | None = None, *, required: bool = False, minimum: float | None = None,
               positive: bool = False) -> float | None:  # fmt: skip
        value = self.get(name, (int, float), default, required=required)
        if value is None:
            return None
        if not math.isfinite(value):
            raise self.error(name, f"expected a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.error(name, f"expected a number > 0, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(name, f"expected a number >= {minimum:g}, got {value!r}")
        return float(value)

    def integer(
        self, name: str, default: int | None = None, *, required: bool = False, minimum: int = 0
    ) -> int | None:
        value = self.get(name, int, default, required=required)
        if value is not None and value < minimum:
            raise self.error(name, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
        value = self.get(name, str, default)
        if value is not None and value not in choices:
            raise self.error(name, f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
        return value

    def table(self, name: str) -> Table | None:
        value = self.raw(name)
        return None if value is None else Table(value, self.source, self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise self.error(unknown[0], f"unknown key (known keys here: {known})")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _expected(kind: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "a table"}  # fmt: skip
    kinds = _as_tuple(kind)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(names.get(k, k.__name__) for k in kinds)
