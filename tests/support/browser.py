"""Open a report in headless Chromium over the DevTools protocol and say what happened.

Used by the tests and ``scripts/bench_report.py``: load time (navigation to the page's load event),
console errors and uncaught exceptions, every network request the page made, whether every chart was
drawn with data (after showing each point in turn), and a PNG screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars")  # fmt: skip

# Visits every point of every run, then lists each chart: is it drawn, how many traces, how many values.
_CHECK_JS = """
(() => {
  for (const sel of document.querySelectorAll('select.point-select')) {
    for (const opt of sel.options) { sel.value = opt.value; sel.dispatchEvent(new Event('change')); }
    sel.value = sel.options[0].value; sel.dispatchEvent(new Event('change'));
  }
  return Array.from(document.querySelectorAll('div.chart[data-fig]')).map(div => ({
    fig: div.dataset.fig,
    drawn: !!div.querySelector('.main-svg'),
    traces: (div.data || []).length,
    empty_traces: (div.data || []).filter(t => !((t.x || []).some(v => v !== null) && (t.y || []).some(v => v !== null))).map(t => t.name),
    values: (div.data || []).reduce((n, t) => n + (t.x || []).filter(v => v !== null).length, 0),
    axis_titles: Array.from(div.querySelectorAll('.g-xtitle, .g-ytitle, [class^="g-x"][class$="title"], [class^="g-y"][class$="title"]'))
      .map(el => el.textContent).filter((t, i, a) => t && a.indexOf(t) === i),
  }));
})()
"""


def find_chromium() -> str:
    """The Chromium binary (``$CHROMIUM`` or ``chromium`` on PATH); a clear error when there is none."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise FileNotFoundError(
            "headless Chromium not found: `apt-get install -y chromium` (or set $CHROMIUM)"
        )
    return path


@dataclass
class PageReport:
    load_s: float  # Page.navigate sent -> Page.loadEventFired received
    nav_load_ms: float  # the page's own PerformanceNavigationTiming.loadEventStart
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(
        default_factory=list
    )  # every URL the page asked for (the page itself included)
    charts: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # the page's performance marks (ms)

    @property
    def network_requests(self) -> list[str]:
        """Requests other than the report file itself and inline data/blob URLs."""
        return [u for u in self.requests[1:] if not re.match(r"(data|blob):", u)]


class _Cdp:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.new_event = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            else:
                self.events.append(data)
                self.new_event.set()

    async def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        i = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        res = await fut
        if "error" in res:
            raise RuntimeError(f"CDP {method} failed: {res['error']}")
        return res.get("result", {})

    async def wait_event(self, method: str) -> dict[str, Any]:
        while True:
            for e in self.events:
                if e.get("method") == method:
                    return e
            self.new_event.clear()
            await self.new_event.wait()


async def _devtools_url(proc: subprocess.Popen[bytes], timeout: float) -> str:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    seen = []
    while time.monotonic() < deadline:
        line = (await loop.run_in_executor(None, proc.stderr.readline)).decode(errors="replace")
        seen.append(line)
        if m := re.search(r"DevTools listening on (ws://\S+)", line):
            return m.group(1)
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("Chromium did not start its DevTools endpoint:\n" + "".join(seen[-20:]))


async def inspect_report(
    path: Path,
    screenshot: Path | None = None,
    *,
    width: int = 1400,
    height: int = 1000,
    timeout: float = 60.0,
    full_page: bool = True,
) -> PageReport:
    """Load ``path`` in a fresh headless Chromium profile and report on it (see module docstring)."""
    # Chromium's helper processes may still write to the profile as they exit: its own session (process
    # group) is ended as a whole, and the profile removal tolerates late files.
    with tempfile.TemporaryDirectory(prefix="servelab-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [
                find_chromium(),
                *FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            return await asyncio.wait_for(
                _inspect(proc, Path(path), screenshot, width, height, timeout, full_page), timeout
            )
        finally:
            _end_session(proc)


def _end_session(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the browser and every process of its session (it is their session leader)."""
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(10.0)
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
            deadline = time.monotonic() + 2.0  # helpers of the group may outlive the leader briefly
            while time.monotonic() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.05)
    finally:
        if proc.stderr is not None:
            proc.stderr.close()


async def _inspect(
    proc: subprocess.Popen[bytes],
    path: Path,
    screenshot: Path | None,
    width: int,
    height: int,
    timeout: float,
    full_page: bool,
) -> PageReport:
    url = await _devtools_url(proc, timeout)
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        cdp = _Cdp(ws)
        target = (await cdp.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        sid = (await cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            await cdp.send(method, session=sid)
        await cdp.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=sid,
        )
        cdp.events.clear()
        t = time.monotonic()
        await cdp.send("Page.navigate", {"url": path.resolve().as_uri()}, session=sid)
        await cdp.wait_event("Page.loadEventFired")
        load_s = time.monotonic() - t

        async def evaluate(expr: str) -> Any:
            res = await cdp.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=sid)
            if "exceptionDetails" in res:
                raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
            return res["result"].get("value")

        nav_ms = float(await evaluate("performance.getEntriesByType('navigation')[0].loadEventStart"))
        marks = await evaluate(
            "Object.fromEntries(performance.getEntriesByType('mark').map(m => [m.name, m.startTime]))"
        )
        charts = await evaluate(_CHECK_JS)
        await asyncio.sleep(0.2)  # let console messages from the checks arrive
        if screenshot is not None and full_page:
            full = int(await evaluate("document.documentElement.scrollHeight"))
            await cdp.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": min(full, 8000), "deviceScaleFactor": 1, "mobile": False},
                session=sid,
            )
            await evaluate("window.dispatchEvent(new Event('resize'))")
            await asyncio.sleep(0.5)
        if screenshot is not None:
            shot = await cdp.send("Page.captureScreenshot", {"format": "png"}, session=sid)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        report = PageReport(load_s=load_s, nav_load_ms=nav_ms, charts=charts, marks=marks)
        for e in cdp.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Network.requestWillBeSent":
                report.requests.append(p["request"]["url"])
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                report.console_errors.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
                )
            elif m == "Runtime.exceptionThrown":
                report.console_errors.append(json.dumps(p["exceptionDetails"])[:500])
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                report.console_errors.append(p["entry"]["text"])
        await cdp.send("Browser.close")
        cdp.reader.cancel()
        return report


def inspect_report_sync(path: Path, screenshot: Path | None = None, **kw: Any) -> PageReport:
    return asyncio.run(inspect_report(path, screenshot, **kw))
