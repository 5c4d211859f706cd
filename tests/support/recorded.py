"""Live capacity runs' probes as recorded (tests/fixtures/capacity/), for replaying the search and the fit."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.capacity.probe import Probe
from loadgen.capacity.stats import SloCheck

FIXTURES = Path(__file__).parent.parent / "fixtures" / "capacity"


def recorded_probes(name: str) -> list[Probe]:
    """The probes of the recorded run ``name`` (a file in tests/fixtures/capacity/), each as measured."""
    data = json.loads((FIXTURES / name).read_text())
    return [Probe(**{**p, "checks": [SloCheck(**c) for c in p["checks"]]}) for p in data["probes"]]
