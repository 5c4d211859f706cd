"""The dispatcher's wake-ups (loadgen.timing.alarm): never before their instant, in order, with or without a timerfd."""

import asyncio
import random

import pytest

from loadgen.timing import alarm as alarm_mod
from loadgen.timing.alarm import Alarm
from loadgen.timing.clock import RunClock


@pytest.fixture(params=["timerfd", "loop timer"])
def make_alarm(request, monkeypatch):
    if request.param == "loop timer":
        monkeypatch.setattr(alarm_mod, "_LIBC", None)
    elif alarm_mod._LIBC is None:
        pytest.fail("this Linux machine has no timerfd_create in its C library")
    return lambda clock: Alarm(clock)


async def test_waiters_wake_after_their_instant_and_in_order(make_alarm):
    clock = RunClock()
    alarm = make_alarm(clock)
    rng = random.Random(1)
    targets = [clock.now() + rng.uniform(0.05, 0.1) for _ in range(200)]
    woke: list[tuple[float, float]] = []
    waited: list[float] = []  # targets still ahead when their wait began (one already past returns at once)

    async def wait(t: float) -> None:
        if t > clock.now():
            waited.append(t)
        await alarm.until(t)
        woke.append((t, clock.now()))

    await asyncio.wait_for(asyncio.gather(*map(wait, targets)), 10)
    alarm.close()
    assert len(woke) == 200 and len(waited) >= 100
    assert all(now >= t for t, now in woke)  # never early
    assert [t for t, _ in woke if t in waited] == sorted(waited)  # in the order of their instants


async def test_call_at_runs_callbacks_and_a_past_instant_at_once(make_alarm):
    clock = RunClock()
    alarm = make_alarm(clock)
    seen: list[tuple[str, float]] = []
    done = asyncio.Event()
    t1 = clock.now() + 0.02
    alarm.call_at(t1, lambda: seen.append(("later", clock.now())) or done.set())
    alarm.call_at(clock.now() - 1.0, lambda: seen.append(("past", clock.now())))
    await asyncio.wait_for(done.wait(), 10)
    alarm.close()
    assert [name for name, _ in seen] == ["past", "later"]
    assert seen[1][1] >= t1


async def test_a_cancelled_waiter_leaves_the_others_on_time(make_alarm):
    clock = RunClock()
    alarm = make_alarm(clock)
    first = asyncio.ensure_future(alarm.until(clock.now() + 0.01))
    t2 = clock.now() + 0.03
    second = asyncio.ensure_future(alarm.until(t2))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.wait_for(second, 10)
    assert clock.now() >= t2 and first.cancelled()
    alarm.close()
