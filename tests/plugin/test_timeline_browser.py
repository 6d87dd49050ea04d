"""The timeline page in a real headless browser (Debian's ``chromium``): rendered, screenshot, measured, offline.

Tier ``-m browser``; skipped when ``/usr/bin/chromium`` is missing (``apt-get install -y chromium``).

The page must fit the window at 1400 px (``document.documentElement.scrollWidth <= window.innerWidth``) for the
sample run, a 13 s run and a 2-hour one, and its zoom buttons must widen the bars (the plot then scrolls inside its
frame, the page still does not).

The page is served from a loopback ``http.server`` that logs every request, and chromium runs with its proxy
pointed at a loopback trap that records every connection and with every host name but 127.0.0.1 unresolvable,
so any fetch leaves a trace and fails. Chromium also makes requests of its own (account and service pings that
no flag turns off), so each run writes a net log (``--log-net-log``) too: a request belongs to the page when
its network isolation key or initiator is the page's site, and the page must request nothing but itself. A
canary page that does fetch remote things proves that the net log and the trap do see such fetches.

Every chromium run has a timeout and runs in its own session with a tag in its environment; on a timeout, or
if anything of it is left after it exits, the session and every tagged process are killed by PID.
"""

from __future__ import annotations

import html
import http.server
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from loopback_server import LoopbackServer

from pytest_sglworker.plugin.timeline import FAILED_COLOUR, PHASE_COLOURS, TEST_COLOURS, render_html

pytestmark = [pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "timeline" / "sample_report.json"
WIDTH, HEIGHT = 1400, 900
RUN_TIMEOUT = 60.0
TAG = "SGLWORKER_TIMELINE_BROWSER"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--disable-breakpad", "--no-pings", "--disable-domain-reliability",
         "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,Translate,MediaRouter",
         "--force-color-profile=srgb", "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]

# Loaded in a frame beside the timeline (same origin); measures what the browser laid out, at the default zoom
# ("fit") and, after a click on a zoom button, zoomed in.
WRAPPER = """<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"></head>
<body style="margin:0">
<pre id="geometry">pending</pre>
<iframe id="f" src="PAGE" width="WIDTH" height="900" style="border:0"></iframe>
<script>
var f = document.getElementById('f');
function geometry(d, w) {
  var all = function (sel, root) {
    return Array.prototype.slice.call((root || d).querySelectorAll(sel)); };
  var box = function (e) { var b = e.getBoundingClientRect(); return [b.left, b.top, b.width, b.height]; };
  var shown = function (e) { return e.getClientRects().length > 0; };
  var scroller = d.querySelector('.plot-scroll');
  return {
    scroll_width: d.documentElement.scrollWidth, inner_width: w.innerWidth,
    plot: d.querySelector('svg.plot') ? box(d.querySelector('svg.plot')) : null,
    scroller: scroller ? [scroller.scrollWidth, scroller.clientWidth] : null,
    lanes: all('g.lane').map(function (e) { return {node: e.dataset.node, gpu: e.dataset.gpu, box: box(e)}; }),
    bars: all('g.bar').map(function (e) {
      var phases = all('rect.phase', e).map(box);
      var left = Math.min.apply(null, phases.map(function (b) { return b[0]; }));
      var right = Math.max.apply(null, phases.map(function (b) { return b[0] + b[2]; }));
      return {launch: e.dataset.launch, gpu: e.dataset.gpu, node: e.dataset.node, box: box(e), phases: phases,
              span: [left, right]}; }),
    marks: all('rect.test-mark').map(function (e) {  // what shows: the box and the stroke around it
      var b = box(e), stroke = parseFloat(w.getComputedStyle(e).strokeWidth) || 0;
      return [b[0] - stroke / 2, b[1] - stroke / 2, b[2] + stroke, b[3] + stroke]; }),
    labels: all('div.bar-label').filter(shown).map(function (e) {
      return {text: e.textContent, box: box(e), room: box(e.parentNode), cut: e.scrollWidth > e.clientWidth + 0.5,
              launch: e.parentNode.parentNode.dataset.launch}; }),
    ticks: all('.tick text').filter(shown).map(box),
    side: all('.lane-labels text').map(function (e) { return {len: e.getComputedTextLength(), box: box(e)}; }),
    side_width: d.querySelector('svg.lane-labels') ? d.querySelector('svg.lane-labels').getBoundingClientRect().width
                                                   : 0,
    legend: all('.legend-item').map(box),
    zoom: all('#zoom input').map(function (e) {
      e.focus();
      return {id: e.id, checked: e.checked, focused: d.activeElement === e,
              label: d.querySelector('label[for="' + e.id + '"]').textContent}; })
  };
}
function measure() {
  var d = f.contentDocument, w = f.contentWindow, out = {fit: geometry(d, w)};
  var button = d.getElementById('zoom-ZOOM');
  if (button) { button.click(); out.zoomed = geometry(d, w); out.zoomed_to = ZOOM; }
  out.html = d.documentElement.outerHTML;
  document.getElementById('geometry').textContent = JSON.stringify(out);
}
if (f.contentDocument && f.contentDocument.readyState === 'complete'
    && f.contentDocument.URL.indexOf('PAGE') >= 0) { measure(); } else { f.onload = measure; }
</script></body></html>"""


def wrapper(page: str, width: int = WIDTH, zoom: int = 0) -> bytes:
    """The measuring page of ``page`` in a frame ``width`` px wide, zoomed to ``zoom`` after the first measure."""
    return WRAPPER.replace("PAGE", page).replace("WIDTH", str(width)).replace("ZOOM", str(zoom)).encode()


def run_of(seconds: float, count: int, *, gpus: int = 2, t0: float = 1_733_150_000.0) -> dict[str, Any]:
    """A run of ``seconds`` with ``count`` launches one after another on each of ``gpus`` GPUs, a failed start
    and a death among them, and its tests."""
    slot = seconds / (count / gpus + 0.5)
    launches = []
    for i in range(count):
        gpu, at = i % gpus, t0 + 0.3 + (i // gpus) * slot + (i % gpus) * slot / 3
        ready, stop = at + 0.1 + slot * 0.3, at + slot * 0.85
        failed, died = i == 1, i == count - 2
        launches.append({
            "id": f"main-{i + 1}", "config": f"qwen3-0.6b-{i}",
            "label": f"qwen3-0.6b --max-total-tokens {512 * (i + 1)}",
            "model": "Qwen/Qwen3-0.6B", "role": "worker", "group": None, "xdist_worker": None, "node": "ci-1",
            "gpus": [gpu], "gpu_names": [f"sim-gpu-{gpu}"], "port": 20000 + 4 * i, "pid": 5000 + i, "argv": "sim",
            "log_path": f"/tmp/logs/sglang-worker-{20000 + 4 * i}.log", "t_lease_requested": at, "t_leased": at + 0.05,
            "t_started": at + 0.1, "t_ready": None if failed else ready, "t_stop_requested": None if failed else stop,
            "t_stopped": stop + slot * 0.05, "t_released": stop + slot * 0.1,
            "outcome": "startup_failed" if failed else "died" if died else "ok",
            "failure": "CUDA out of memory while capturing the prefill CUDA graph" if failed else None,
            "diagnosis": "CUDA out of memory while capturing the prefill CUDA graph" if failed else None,
            "exit_code": -9 if failed or died else None,
            "tests": [{"nodeid": f"tests/test_x.py::test_{i}_{k}[qwen3-0.6b]", "t_start": ready + k * slot * 0.2,
                       "t_end": ready + (k + 0.8) * slot * 0.2, "outcome": "error" if failed or died else "passed"}
                      for k in range(1 if failed else 2)]})
    return {"schema": "pytest-sglworker/report/v1", "engine": "sim", "models": ["qwen3-0.6b"], "exitstatus": 1,
            "interrupted": False, "started_at": t0, "finished_at": t0 + seconds, "workers": {}, "launches": launches,
            "outcomes": {"passed": 2 * count - 4, "failed": 0, "errors": 3, "skipped": 0}}


SHORT_RUN = run_of(13.0, 8)  # 13 s: what a user's first run with the simulated engine's faults looks like
LONG_RUN = run_of(7200.0, 60)  # 2 hours


# Fetches remote things on purpose: the net log and the trap must see them.
CANARY = """<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">
<link rel="stylesheet" href="https://fonts.googleapis.com/css2?family=Roboto">
</head><body><img src="http://fetch-canary.example/pixel.png" alt=""><p>canary</p></body></html>"""


class PageServer:
    """Loopback HTTP server of fixed pages; logs every request path."""

    def __init__(self, pages: dict[str, bytes]) -> None:
        self.pages = pages
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                body = server.pages.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_HEAD = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Trap(LoopbackServer):
    """What chromium's proxy points at: records the first line of every connection, then closes it."""

    timeout = 2.0

    def __init__(self) -> None:
        self.seen: list[str] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        try:
            first = conn.recv(400).split(b"\r\n", 1)[0].decode("latin-1")
        except OSError:  # opened and left idle: a preconnect that never carried a request
            first = ""
        if first:  # chromium preconnects to its proxy and may close the socket unused: no request, no target
            self.seen.append(first)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _kill_all(proc: subprocess.Popen[bytes], tag: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass
    for left in _tagged(tag):
        try:
            left.kill()
        except psutil.Error:
            pass


def run_chromium(tmp_path: Path, trap: Trap, *args: str, timeout: float = RUN_TIMEOUT) -> tuple[bytes, list[str]]:
    """Run chromium once; returns its stdout and every URL of the net log's requests (page and browser)."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / f"chromium-{tag[:8]}"
    (run_dir / "home").mkdir(parents=True)
    netlog = run_dir / "netlog.json"
    cmd = [str(CHROMIUM), *FLAGS, f"--user-data-dir={run_dir / 'profile'}", f"--proxy-server=127.0.0.1:{trap.port}",
           f"--log-net-log={netlog}", *args]
    env = {**os.environ, TAG: tag, "HOME": str(run_dir / "home")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc, tag)
        _, err = proc.communicate()
        pytest.fail(f"chromium ran past {timeout}s and was killed: {err.decode(errors='replace')[-3000:]}")
    finally:
        deadline = time.monotonic() + 5
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        _kill_all(proc, tag)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return out, page_requests(netlog)


def page_requests(netlog: Path) -> list[str]:
    """``"page <url>"`` or ``"browser <url>"`` for every URL request in a chromium net log."""
    text = netlog.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # cut short: the format is made to be closed this way
        data = json.loads(text.rstrip().rstrip(",") + "]}")
    start_job = data["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    found = []
    for event in data["events"]:
        params = event.get("params") or {}
        if event["type"] == start_job and "url" in params:
            nik, initiator = str(params.get("network_isolation_key", "")), str(params.get("initiator", ""))
            mine = "http://127.0.0.1" in nik or initiator.startswith("http://127.0.0.1")
            found.append(f"{'page' if mine else 'browser'} {params['url']}")
    return found


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit, non-interlaced RGB or RGBA PNG (stdlib only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert header is not None
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, header
    bpp = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    assert len(raw) == height * (stride + 1)
    prev, rows = bytearray(stride), []
    for y in range(height):
        kind_, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind_ == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind_ == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev, strict=True))
        elif kind_ == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif kind_ == 4:
            for i in range(stride):
                a, b, c = (line[i - bpp] if i >= bpp else 0), prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(v for i, v in enumerate(line) if i % 4 != 3))
    return width, height, rows


def overlap(a: list[float], b: list[float], slack: float = 0.5) -> bool:
    return (a[0] + slack < b[0] + b[2] and b[0] + slack < a[0] + a[2]
            and a[1] + slack < b[1] + b[3] and b[1] + slack < a[1] + a[3])


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"the browser tier needs Debian's chromium at {CHROMIUM}: apt-get install -y chromium")
    return CHROMIUM


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SAMPLE.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def served(sample: dict[str, Any]) -> Iterator[PageServer]:
    server = PageServer({"/timeline.html": render_html(sample).encode(),
                         "/short.html": render_html(SHORT_RUN).encode(), "/long.html": render_html(LONG_RUN).encode(),
                         "/wrapper.html": wrapper("/timeline.html", zoom=8),
                         "/wrap-short.html": wrapper("/short.html", zoom=4),
                         "/wrap-long.html": wrapper("/long.html", zoom=32), "/canary.html": CANARY.encode()})
    yield server
    server.close()


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.close()


def assert_offline(served: PageServer, trap: Trap, requests: list[str], pages: list[str]) -> None:
    mine = [r.split(" ", 1)[1] for r in requests if r.startswith("page ")]
    assert sorted(mine) == sorted(served.origin + p for p in pages), requests
    assert sorted(served.requests) == sorted(pages)
    browser_hosts = {r.split("/")[2] for r in requests if r.startswith("browser ")}
    for line in trap.seen:  # the browser's own pings, none from the page
        target = line.split()[1] if len(line.split()) > 1 else line
        host = target.split("/")[2] if "://" in target else target
        assert host in browser_hosts or host.rsplit(":", 1)[0] in browser_hosts, (line, requests)


def test_screenshot_shows_lanes_bars_and_colours(chromium: Path, served: PageServer, trap: Trap,
                                                 tmp_path: Path) -> None:
    served.requests.clear()
    png = tmp_path / "timeline.png"
    _, requests = run_chromium(tmp_path, trap, f"--screenshot={png}", f"--window-size={WIDTH},{HEIGHT}",
                               served.origin + "/timeline.html")
    assert_offline(served, trap, requests, ["/timeline.html"])
    width, height, rows = decode_png(png.read_bytes())
    assert (width, height) == (WIDTH, HEIGHT)
    counts: dict[bytes, int] = {}
    for row in rows:
        for i in range(0, len(row), 3):
            px = row[i:i + 3]
            counts[px] = counts.get(px, 0) + 1
    white = counts.get(b"\xff\xff\xff", 0)
    assert len(counts) > 50 and white < 0.9 * width * height, (len(counts), white)
    for name, colour in [*PHASE_COLOURS.items(), ("failed", FAILED_COLOUR), ("passed", TEST_COLOURS["passed"])]:
        assert counts.get(bytes.fromhex(colour[1:]), 0) > 40, f"{name} ({colour}) is not on the screen"
    assert counts[bytes.fromhex(PHASE_COLOURS["serving"][1:])] > 20_000  # the bars are bars, not slivers


def measure(tmp_path: Path, trap: Trap, served: PageServer, page: str, wrap: str) -> dict[str, Any]:
    """The geometry the wrapper ``wrap`` measured of ``page`` (offline: nothing but the two pages requested)."""
    served.requests.clear()
    out, requests = run_chromium(tmp_path, trap, "--dump-dom", f"--window-size={WIDTH},{HEIGHT}", served.origin + wrap)
    assert_offline(served, trap, requests, [wrap, page])
    dumped = out.decode()
    start = dumped.index('<pre id="geometry">') + len('<pre id="geometry">')
    geo: dict[str, Any] = json.loads(html.unescape(dumped[start:dumped.index("</pre>", start)]))
    return geo


def assert_fits(geo: dict[str, Any], *, zoomed: bool = False) -> None:
    """The page needs no sideways scrolling: the document is no wider than the window, nor is the plot (zoomed
    in, the plot is wider and scrolls inside its frame)."""
    assert geo["inner_width"] == WIDTH
    assert geo["scroll_width"] <= geo["inner_width"], (geo["scroll_width"], geo["inner_width"])
    assert (geo["plot"][0] + geo["plot"][2] > geo["inner_width"]) == zoomed
    assert geo["scroller"][0] > geo["scroller"][1] if zoomed else geo["scroller"][0] <= geo["scroller"][1]


def assert_labels_fit(geo: dict[str, Any]) -> None:
    """Every label stays in its room (cut there by the browser), overlaps no other label and no other bar."""
    phases = [(bar["launch"], b) for bar in geo["bars"] for b in bar["phases"]]
    for label in geo["labels"]:
        assert label["box"][0] + label["box"][2] <= label["room"][0] + label["room"][2] + 0.5, label
        assert not [b for launch, b in phases if launch != label["launch"] and overlap(label["box"], b)], label
    for a, b in itertools.combinations([x["box"] for x in geo["labels"]], 2):
        assert not overlap(a, b), ("labels", a, b)
    for a, b in itertools.combinations(geo["ticks"], 2):
        assert not overlap(a, b), ("ticks", a, b)


def assert_zoom_widens(geo: dict[str, Any]) -> None:
    """After the click on "Nx": the plot is N times wider and scrolls in its frame; the page still fits."""
    zoom, fit, zoomed = geo["zoomed_to"], geo["fit"], geo["zoomed"]
    assert [z["checked"] for z in zoomed["zoom"]] == [z["id"] == f"zoom-{zoom}" for z in zoomed["zoom"]]
    assert all(z["focused"] for z in fit["zoom"]), fit["zoom"]  # each button takes the keyboard's focus
    assert_fits(zoomed, zoomed=True)
    assert zoomed["scroller"][0] == pytest.approx(zoom * zoomed["scroller"][1], abs=2)  # it scrolls inside
    widths = [(a["span"][1] - a["span"][0], b["span"][1] - b["span"][0]) for a, b in
              zip(fit["bars"], zoomed["bars"], strict=True) if a["span"][1] - a["span"][0] >= 4]
    assert widths and all(after == pytest.approx(zoom * before, rel=0.1, abs=2) for before, after in widths), widths
    assert len(zoomed["labels"]) >= len(fit["labels"])
    assert_labels_fit(zoomed)


def test_rendered_dom_and_layout(chromium: Path, served: PageServer, trap: Trap, sample: dict[str, Any],
                                 tmp_path: Path) -> None:
    geo = measure(tmp_path, trap, served, "/timeline.html", "/wrapper.html")
    fit = geo["fit"]
    assert_fits(fit)
    launches = sample["launches"]
    lanes = {(r["node"], str(g)) for r in launches for g in r["gpus"]} | {(r["node"], "none") for r in launches
                                                                          if not r["gpus"]}
    assert sorted((ln["node"], ln["gpu"]) for ln in fit["lanes"]) == sorted(lanes)
    assert len(fit["bars"]) == sum(max(1, len(r["gpus"])) for r in launches)
    assert len(fit["marks"]) == sum(len(r["tests"]) * max(1, len(r["gpus"])) for r in launches)
    for bar in fit["bars"]:  # every bar is laid out, inside its lane
        lane = next(ln for ln in fit["lanes"] if (ln["node"], ln["gpu"]) == (bar["node"], bar["gpu"]))
        assert bar["span"][1] - bar["span"][0] >= 2 and bar["box"][3] > 10, bar
        assert lane["box"][1] - 0.5 <= bar["box"][1] and bar["box"][1] + bar["box"][3] <= sum(lane["box"][1::2]) + 4
    # the failed starts and the death, on the GPUs they ran on
    where = {(b["launch"], b["node"], b["gpu"]) for b in fit["bars"]}
    assert {("gw0-3", "node-a", "0"), ("gw1-2", "node-a", "1"), ("gw2-5", "node-b", "2"),
            ("gw2-6", "node-b", "3")} <= where
    assert all(m[2] >= 1 and m[3] >= 4 for m in fit["marks"])
    assert_labels_fit(fit)
    assert any(label["cut"] for label in fit["labels"])  # a label cut at the next bar, with an ellipsis
    for kind in ("side", "legend"):
        boxes = [x["box"] if isinstance(x, dict) else x for x in fit[kind]]
        for a, b in itertools.combinations(boxes, 2):
            assert not overlap(a, b), (kind, a, b)
    assert all(x["len"] <= fit["side_width"] - 8 for x in fit["side"]), fit["side"]
    assert [z["label"] for z in fit["zoom"]] == ["fit"] + [f"{z}\N{MULTIPLICATION SIGN}" for z in (2, 4, 8, 16, 32)]
    assert_zoom_widens(geo)
    # the browser's own DOM of the page: no script, the hostile strings stayed text
    page = geo["html"]
    assert "<script" not in page and page.count('class="bar"') == len(fit["bars"])
    assert "&lt;script&gt;alert" in page and page.count('class="lane"') == len(lanes)


@pytest.mark.parametrize(("page", "wrap", "seconds"), [("/short.html", "/wrap-short.html", 13.0),
                                                        ("/long.html", "/wrap-long.html", 7200.0)],
                         ids=["13s", "2h"])
def test_a_short_and_a_long_run_fit_the_window_and_zoom_in(chromium: Path, served: PageServer, trap: Trap,
                                                             tmp_path: Path, page: str, wrap: str,
                                                             seconds: float) -> None:
    geo = measure(tmp_path, trap, served, page, wrap)
    fit = geo["fit"]
    assert_fits(fit)
    run = SHORT_RUN if seconds < 60 else LONG_RUN
    assert run["finished_at"] - run["started_at"] == seconds
    assert len(fit["bars"]) == len(run["launches"])
    right = max(bar["span"][1] for bar in fit["bars"])
    assert fit["plot"][0] + fit["plot"][2] * 0.8 < right <= fit["plot"][0] + fit["plot"][2] + 1  # the whole run
    assert_labels_fit(fit)
    assert len(fit["ticks"]) >= 4
    assert_zoom_widens(geo)


def test_the_detector_sees_a_page_that_fetches(chromium: Path, served: PageServer, trap: Trap,
                                               tmp_path: Path) -> None:
    served.requests.clear()
    _, requests = run_chromium(tmp_path, trap, "--dump-dom", served.origin + "/canary.html")
    mine = {r.split(" ", 1)[1].split("?")[0] for r in requests if r.startswith("page ")}
    assert {"http://fetch-canary.example/pixel.png", "https://fonts.googleapis.com/css2"} <= mine, requests
    assert any("fetch-canary.example" in line for line in trap.seen), trap.seen
    with pytest.raises(AssertionError):
        assert_offline(served, trap, requests, ["/canary.html"])
