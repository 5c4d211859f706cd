"""`--ray`: the load workers as Ray actors, on a local Ray instance with 2 actors against the null server."""

import pytest

from backends.openai import OpenAIBackend
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl

pytestmark = pytest.mark.ray  # not in the default run (pyproject addopts): run with -m ray after pip install '.[ray]'


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_two_ray_actors_merge_records_with_clock_offsets(local_ray, null_server, tmp_path):
    load = LoadSpec("poisson", rate=100, num_requests=60, warmup=4, seed=5)
    s = await run_point(OpenAIBackend(null_server, model="null"), FixedWorkload(max_tokens=4), load, tmp_path,
                        RunClock(), options=PointOptions(fleet=Fleet(2, ray="local")))  # fmt: skip
    recs = read_jsonl(tmp_path / "requests.jsonl")
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 60 and len(recs) == 64
    w = s["workers"]
    assert w["count"] == 2 and w["lost"] == [] and {p["kind"] for p in w["per_worker"]} == {"ray"}
    for p in w["per_worker"]:  # measured, bounded; the same machine's clock: the offset is within its bound
        assert 0 < p["bound_s"] < 0.5 and abs(p["offset_s"]) <= p["bound_s"] + 1e-3
    assert w["clock_bound_s"] == max(p["bound_s"] for p in w["per_worker"])
    assert sorted(int(r["id"][1:]) for r in recs) == list(range(64))  # every session once, records came back
    # corrected onto the coordinator's clock: every measured send at or after the measured start, in order
    assert all(r["sent"] >= s["t_measured"] - w["clock_bound_s"] for r in recs if not r["warmup"])
