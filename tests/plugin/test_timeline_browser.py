"""The timeline page in a real headless browser (Debian's ``chromium``): rendered, screenshot, measured, offline.

Tier ``-m browser``; skipped when ``/usr/bin/chromium`` is missing (``apt-get install -y chromium``).

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

from pytest_sglworker.plugin.timeline import FAILED_COLOUR, PHASE_COLOURS, TEST_COLOURS, render_html

pytestmark = [pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "timeline" / "sample_report.json"
WIDTH, HEIGHT = 1600, 900
RUN_TIMEOUT = 60.0
TAG = "SGLWORKER_TIMELINE_BROWSER"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--disable-breakpad", "--no-pings", "--disable-domain-reliability",
         "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,Translate,MediaRouter",
         "--force-color-profile=srgb", "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]

# Loaded in a frame beside the timeline (same origin); measures what the browser laid out.
WRAPPER = """<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"></head>
<body style="margin:0">
<pre id="geometry">pending</pre>
<iframe id="f" src="/timeline.html" width="1600" height="900" style="border:0"></iframe>
<script>
var f = document.getElementById('f');
function measure() {
  var d = f.contentDocument;
  var all = function (sel) { return Array.prototype.slice.call(d.querySelectorAll(sel)); };
  var box = function (e) { var b = e.getBoundingClientRect(); return [b.left, b.top, b.width, b.height]; };
  var out = {
    lanes: all('g.lane').map(function (e) { return {node: e.dataset.node, gpu: e.dataset.gpu, box: box(e)}; }),
    bars: all('g.bar').map(function (e) {
      return {launch: e.dataset.launch, gpu: e.dataset.gpu, node: e.dataset.node, box: box(e)}; }),
    marks: all('rect.test-mark').map(box),
    labels: all('text.bar-label').map(function (e) {
      return {text: e.textContent, len: e.getComputedTextLength(), maxw: +e.dataset.maxw, box: box(e)}; }),
    ticks: all('.tick text').map(box),
    side: all('.lane-labels text').map(function (e) { return {len: e.getComputedTextLength(), box: box(e)}; }),
    side_width: d.querySelector('svg.lane-labels').getBoundingClientRect().width,
    legend: all('.legend-item').map(box),
    html: d.documentElement.outerHTML
  };
  document.getElementById('geometry').textContent = JSON.stringify(out);
}
if (f.contentDocument && f.contentDocument.readyState === 'complete'
    && f.contentDocument.URL.indexOf('/timeline.html') >= 0) { measure(); } else { f.onload = measure; }
</script></body></html>"""

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


class Trap:
    """What chromium's proxy points at: records the first line of every connection, then closes it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(400).split(b"\r\n", 1)[0].decode("latin-1"))
                except OSError:
                    self.seen.append("?")

    def close(self) -> None:
        self.sock.close()


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
    server = PageServer({"/timeline.html": render_html(sample).encode(), "/wrapper.html": WRAPPER.encode(),
                         "/canary.html": CANARY.encode()})
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


def test_rendered_dom_and_layout(chromium: Path, served: PageServer, trap: Trap, sample: dict[str, Any],
                                 tmp_path: Path) -> None:
    served.requests.clear()
    out, requests = run_chromium(tmp_path, trap, "--dump-dom", f"--window-size={WIDTH},{HEIGHT}",
                                 served.origin + "/wrapper.html")
    assert_offline(served, trap, requests, ["/wrapper.html", "/timeline.html"])
    dumped = out.decode()
    start = dumped.index('<pre id="geometry">') + len('<pre id="geometry">')
    geo = json.loads(html.unescape(dumped[start:dumped.index("</pre>", start)]))
    launches = sample["launches"]
    lanes = {(r["node"], str(g)) for r in launches for g in r["gpus"]} | {(r["node"], "none") for r in launches
                                                                          if not r["gpus"]}
    assert sorted((ln["node"], ln["gpu"]) for ln in geo["lanes"]) == sorted(lanes)
    assert len(geo["bars"]) == sum(max(1, len(r["gpus"])) for r in launches)
    assert len(geo["marks"]) == sum(len(r["tests"]) * max(1, len(r["gpus"])) for r in launches)
    for bar in geo["bars"]:  # every bar is laid out, inside its lane
        lane = next(ln for ln in geo["lanes"] if (ln["node"], ln["gpu"]) == (bar["node"], bar["gpu"]))
        assert bar["box"][2] >= 2 and bar["box"][3] > 10, bar
        assert lane["box"][1] - 0.5 <= bar["box"][1] and bar["box"][1] + bar["box"][3] <= sum(lane["box"][1::2]) + 4
    assert all(m[2] >= 1 and m[3] >= 4 for m in geo["marks"])
    for label in geo["labels"]:  # each label fits the room it was given, with the real font
        assert label["len"] <= label["maxw"] + 0.5, label
    for kind in ("labels", "ticks", "side", "legend"):
        boxes = [x["box"] if isinstance(x, dict) else x for x in geo[kind]]
        for a, b in itertools.combinations(boxes, 2):
            assert not overlap(a, b), (kind, a, b)
    assert all(x["len"] <= geo["side_width"] - 8 for x in geo["side"]), geo["side"]
    # the browser's own DOM of the page: no script, the hostile strings stayed text
    page = geo["html"]
    assert "<script" not in page and page.count('class="bar"') == len(geo["bars"])
    assert "&lt;script&gt;alert" in page and page.count('class="lane"') == len(lanes)


def test_the_detector_sees_a_page_that_fetches(chromium: Path, served: PageServer, trap: Trap,
                                               tmp_path: Path) -> None:
    served.requests.clear()
    _, requests = run_chromium(tmp_path, trap, "--dump-dom", served.origin + "/canary.html")
    mine = {r.split(" ", 1)[1].split("?")[0] for r in requests if r.startswith("page ")}
    assert {"http://fetch-canary.example/pixel.png", "https://fonts.googleapis.com/css2"} <= mine, requests
    assert any("fetch-canary.example" in line for line in trap.seen), trap.seen
    with pytest.raises(AssertionError):
        assert_offline(served, trap, requests, ["/canary.html"])
