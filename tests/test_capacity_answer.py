"""The capacity search's answer: its estimate where the probes' point estimates cross, the default probe length
at the server's own pace (issue 40), and what a budget-bound answer says."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from support.service_models import CHAT_SHORT, REFERENCE_LIKE, SIM, SIM_JOB

from loadgen.capacity.config import SearchConfig
from loadgen.capacity.fit import Fit
from loadgen.capacity.probe import Probe
from loadgen.capacity.result import make_result
from loadgen.capacity.search import judge_s, point_crossing, search
from loadgen.capacity.stats import SloCheck
from loadgen.dispatch.signals import run_async
from loadgen.metrics.slo import parse_slos
from loadgen.testservers.servicemodel import ServiceModel, SimProber


def test_the_estimate_is_where_the_probes_point_estimates_cross():
    """Issue 40's run: c = 8 confirmed, 32, 53 and 64 passed on their point estimates, 96 failed; the answer
    was "capacity 8" with the pilot's 32 as its estimate. The estimate is now the point-estimate crossing
    within the confirmed bracket (64), and the search's answer says so."""
    (slo,) = parse_slos("tpot_p90=150ms", percentiles=True)

    def probe(load, misses, confident=False):
        c = SloCheck(slo.key, slo.limit, 100, misses, 0.0, 1.0, 0.1, None, None, "open")
        return Probe(0, "search", "concurrency", load, "pass" if misses <= 10 else "fail", confident, "", 60.0, 100, 0, [c])

    probes = [probe(8, 0, True), probe(32, 2), probe(53, 5), probe(64, 9), probe(96, 40, True), probe(67, 0)]
    assert point_crossing(probes, [slo], 8, 96) == 67  # 67 passed too (below the lowest point-estimate fail)
    assert point_crossing([*probes, probe(60, 30)], [slo], 8, 96) == 53  # a fail at 60 caps it
    assert point_crossing(probes[:1], [slo], 8, 96) == 8 and point_crossing([probe(96, 40)], [slo], None, None) is None
    slos = parse_slos("tpot_p90=9.5ms", percentiles=True)  # the simulator's capacity is 5 sessions
    res = run_async(search(SimProber(SIM, SIM_JOB, slos, seed=1), slos, SearchConfig("concurrency", budget_s=6)))
    assert res.estimate == 5 and re.search(r"capacity (about )?5 concurrency", res.message), res.message
    lo, hi = res.interval
    assert lo is not None and hi is not None and lo <= 5 < hi, res.message  # the probes' fit, pilot included


class _Caps(SimProber):
    """The simulated prober, recording each probe's phase, load and time cap."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.caps: list[tuple[str, float, float]] = []

    async def probe(self, mode, load, seq, max_seconds, index, phase) -> Probe:
        self.caps.append((phase, load, max_seconds))
        return await super().probe(mode, load, seq, max_seconds, index, phase)


def _paced(scale: float) -> ServiceModel:
    """REFERENCE_LIKE with every cost times ``scale``: the same server at another pace (its SLOs scaled with it,
    the same capacity)."""
    m = REFERENCE_LIKE
    return replace(m, prefill_base=m.prefill_base * scale, prefill_per_token=m.prefill_per_token * scale,
                   decode_base=m.decode_base * scale, decode_per_seq=m.decode_per_seq * scale)  # fmt: skip


@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_issue_40_probe_length_follows_the_servers_pace(scale):
    """Issue 40, point 4: the default probe length scales with the server's own pace. Issue 40's search (--budget
    480, every other option its default) on the reference-like server 10x faster (~55 req/s at its capacity) and
    3x slower (~1.8 req/s), its SLOs scaled with it (the capacity stays 66): every search probe's cap is the
    time for the independent requests a p90 needs at the pace the pilot measured, so the fast server's probes
    are capped near 40 s, the slow one's at the quarter of the budget (the default was 60 s for both, and the slow
    server's pilot at 128 sessions finished no request in it); the slow server's pilot probes run as long as
    their waves take. Every interval holds the truth within ±30 %, every estimate within ±15 %."""
    slos = parse_slos(f"ttft_p90={2000 * scale:g}ms,tpot_p90={150 * scale:g}ms", percentiles=True)
    truth = 66.0  # true_capacity of REFERENCE_LIKE in the issue-40 test; every time scaled, the same
    for seed in range(10):
        prober = _Caps(_paced(scale), CHAT_SHORT, slos, seed=seed)
        res = run_async(search(prober, slos, SearchConfig("concurrency", budget_s=480)))
        lo, hi = res.interval
        assert lo is not None and hi is not None and lo <= truth < hi, (res.message, prober.caps)
        assert lo >= 0.7 * truth and hi <= 1.3 * truth and abs(res.estimate - truth) <= 0.15 * truth, res.message
        assert res.probe_seconds <= 480 and all(p.requests for p in res.probes), prober.caps
        caps = [cap for phase, _, cap in prober.caps if phase == "search"]
        assert caps, prober.caps
        # the last probe the budget holds may take what is left of it (a remainder too short for another probe)
        left = 480 - sum(p.seconds for p in res.probes[:-1])
        assert res.probes[-1].phase == "search" and caps[-1] <= left + 1e-9, (caps, left)
        if scale < 1:
            assert all(10 <= cap <= 50 for cap in caps[:-1]) and caps[-1] >= 10, caps
        else:
            assert all(cap == 120 for cap in caps[:-1]) and caps[-1] >= 120, caps
            assert max(cap for phase, _, cap in prober.caps if phase == "pilot") > 60, prober.caps
    cfg = SearchConfig("concurrency", budget_s=480, max_probe_s=30)  # a --max-probe-s given wins
    assert cfg.probe_cap(slos, 66, False, None, res.probes) == 30 and cfg.pilot_cap(128, res.probes, 256) == 30


def test_a_closed_loop_probe_is_sized_to_the_pace_between_its_bounds():
    """The closed-loop cap: the first wave and the waves of 30 independent requests (a wave counting once before any
    search probe measured its design effect), each the nearest probe's mean E2E, x 1.25, between 10 s and a quarter
    of the budget; 60 s before any probe finished a request; --max-probe-s wins."""
    (slo,) = parse_slos("tpot_p90=150ms", percentiles=True)
    cfg = SearchConfig("concurrency", budget_s=600)

    def done(e2e: float) -> Probe:
        return Probe(0, "pilot", "concurrency", 8.0, "pass", False, "", 1.0, 16, 0, [], mean_e2e=e2e, max_e2e=2 * e2e)

    assert cfg.closed_cap([slo], 8, []) == 60.0
    assert cfg.closed_cap([slo], 8, [done(0.5)]) == pytest.approx(1.25 * 31 * 0.5)  # 31 waves of 0.5 s
    assert cfg.closed_cap([slo], 8, [done(0.1)]) == 10.0  # a fast server: the floor
    assert cfg.closed_cap([slo], 8, [done(5.0)]) == 150.0  # a slow one: a quarter of the budget
    assert cfg.closed_cap([slo], 16, [done(0.5)]) == pytest.approx(2 * 1.25 * 31 * 0.5)  # twice the sessions: the wave
    assert replace(cfg, max_probe_s=45).probe_cap([slo], 8, False, None, [done(5.0)]) == 45.0
    assert replace(cfg, max_probe_s=45).pilot_cap(8, [done(5.0)], 16) == 45.0
    assert cfg.pilot_cap(16, [done(20.0)], 32) == 1.25 * 2 * 40.0  # two waves of twice the E2E
    assert cfg.pilot_cap(16, [done(5.0)], 32) == 60.0  # at least 60 s
    assert judge_s(cfg, [done(0.5)], "concurrency", 8) == pytest.approx(1.0 + 0.5 * 4)  # slowest, then 4 waves


def test_a_probe_its_time_cannot_judge_is_not_run_and_the_message_says_what_would_run_it():
    """Issue 40, point 3: a probe that its --max-probe-s (given) would end before it judged its first 30
    requests is not run (the reference-like server's waves of 64 sessions take ~12 s, the first one's slowest
    ~20 s): the run ends on its budget, no probe without a judged request, and the message names the probe time and
    budget that would run it. Without --max-probe-s such a probe is sized to fit what is left of the budget."""
    slos = parse_slos("ttft_p90=2s,tpot_p90=150ms", percentiles=True)
    res = run_async(search(SimProber(REFERENCE_LIKE, CHAT_SHORT, slos), slos,
                           SearchConfig("concurrency", budget_s=480, max_probe_s=15)))  # fmt: skip
    assert res.status == "budget" and all(p.requests for p in res.probes), [(p.load, p.requests) for p in res.probes]
    hint = re.search(r"needs ~(\d+) s to judge its first 30 requests; the longest probe \(15 s\) is too short for it: "
                     r"--max-probe-s (\d+) and --budget (\d+) would run it", res.message)  # fmt: skip
    assert hint is not None and int(hint[2]) > 15, res.message


def test_a_fit_open_at_an_end_still_headlines_its_estimate():
    """The live run of issue 40's command (fix2, 2026-11-28): probes at 35 (a confirmed fail), 30 and 31 (passes
    on their point estimates) fitted to 33, whose interval three loads could not bound below; the message said
    only "the bracket held is [?, 35]". It headlines the estimate, says which end is open, and gives the bracket."""
    (slo,) = parse_slos("tpot_p90=150ms", percentiles=True)
    probes = [Probe(0, "search", "concurrency", 35, "fail", True, "", 82.0, 155, 0, [])]
    res = make_result("budget", SearchConfig("concurrency", budget_s=480), [slo], None, 35.0, 33.0, 486.0, probes,
                      Fit(None, None, 33.0, 3, "the percentiles"))  # fmt: skip
    assert res.message.startswith("time budget of 480 probe-seconds ran out: capacity about 33 concurrency (the "
                                  "percentiles of the 3 probes near the crossing"), res.message  # fmt: skip
    assert "not bounded below or above yet); the confirmed bracket is [?, 35] concurrency" in res.message
