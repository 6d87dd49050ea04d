"""The run's timeline, drawn from the run report's ``launches``: a self-contained HTML page and Chrome trace JSON.

Plain Python, stdlib only, no pytest: :func:`render_html` / :func:`write_html` (``--sgl-timeline PATH``) and
:func:`trace_events` / :func:`write_trace` (``--sgl-trace PATH``, for Perfetto and ``chrome://tracing``).

Both read the same model. Every time is optional and untrusted: a missing end falls back to the next recorded
time of the launch, else to the run's end (and is marked open); negative durations (clock skew between xdist
workers or nodes) are clipped to zero; phases of a launch are kept in order. Lanes are one per GPU per node,
plus a "no GPU" lane per node for routers and runs without an inventory; a launch with several GPUs is drawn in
each of its lanes. Launches that overlap in one lane (a lease wait under the previous holder, or several
workers without GPUs) are packed into rows, so that no two bars overlap and every trace thread nests properly.

The page fits the run in the window's width: the plot's horizontal coordinates are percentages of its width, which
is the window's at zoom "fit" (no sideways scrolling, whether the run lasted 13 s or 2 hours); zoom buttons (radio
buttons: Tab, then the arrow keys) make it 2, 4, ... times wider, and it scrolls sideways inside its frame. The
header counts the tests as pytest's summary line does (the report's ``outcomes``), and the tests served once each.

The page fetches nothing: inline CSS and SVG, no script (zooming is CSS ``:has()`` on the checked button, hover
text is SVG ``<title>``), a Content Security Policy of ``default-src 'none'``, and a ``data:`` favicon. Every string
from the report is escaped.

Why one module of this size: the HTML page and the Chrome trace are two renderings of one tolerant model of the
report (the parsing of untrusted times is shared), and the page is self-contained: its SVG and CSS are written
here, no template files.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FAILED_COLOUR", "PHASE_COLOURS", "PHASE_NAMES", "TEST_COLOURS", "exit_text", "fmt_duration",
           "render_html", "trace_events", "truncate", "write_html", "write_trace"]

PHASE_NAMES = {"lease": "lease wait", "startup": "startup", "serving": "serving", "teardown": "teardown"}
PHASE_COLOURS = {"lease": "#c8bd9f", "startup": "#f0b43c", "serving": "#4f8fd6", "teardown": "#9ba6b2"}
TEST_COLOURS = {"passed": "#1f8a4c", "failed": "#d62839", "error": "#a3229b", "skipped": "#9aa3ad"}
FAILED_COLOUR = "#d62839"  # a failed start's phase, the outline of failed and dead launches, death marks
OPEN_COLOUR = "#6b3fa0"  # the end of a bar with no recorded end (interrupted run): drawn to the run's end
_OTHER_TEST = "#555555"
FAILED_OUTCOMES = frozenset({"startup_failed", "startup_timeout"})
_OUTCOME_TAGS = {"startup_failed": "startup failed", "startup_timeout": "startup timeout", "died": "died",
                 "interrupted": "interrupted", "cancelled": "cancelled"}
#: a test's outcome from its spans when the report has no pytest counts (an older report): the worst first
_WORST_FIRST = ("failed", "error", "xpassed", "xfailed", "skipped", "passed")
#: how pytest's summary line names the count of each outcome
_COUNT_KEYS = {"passed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped",
               "xfailed": "xfailed", "xpassed": "xpassed"}
_COUNTED = (*_COUNT_KEYS.values(), "rerun")
_TIME_KEYS = ("t_lease_requested", "t_leased", "t_started", "t_ready", "t_stop_requested", "t_stopped",
              "t_released")
# phase: (start key, nominal end key); a missing end falls back to the next recorded time after it
_PHASE_KEYS = {"lease": ("t_lease_requested", "t_leased"), "startup": ("t_started", "t_ready"),
               "serving": ("t_ready", "t_stop_requested"), "teardown": ("t_stop_requested", "t_released")}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_HOVER_TESTS = 40  # tests listed in a bar's hover text; every test mark has its own

# layout, px
_LABEL_W = 210
#: the plot's width at zoom "fit" that tick steps and bar labels are worked out for (about what a 1400 px window
#: leaves it); the zoom levels double it up to _MAX_ZOOM, until a second is _DENSITY px wide
_REF_W, _MAX_ZOOM, _DENSITY = 1000, 32, 200
_LABEL_MIN_W, _LABEL_MAX_CHARS = 48, 400  # a bar label needs this much room (a few letters); longer ones are cut
_AXIS_H, _NODE_H, _ROW_H, _BAR_Y, _BAR_H, _MARK_Y, _MARK_H = 28, 24, 30, 3, 18, 23, 5


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return int(number) if number is not None else None


def _time(value: Any) -> float | None:
    """An epoch time (or any seconds count) within reason: a wild value would squash the whole axis."""
    number = _num(value)
    return number if number is not None and abs(number) < 1e12 else None


def _text(value: Any, default: str = "") -> str:
    """A clean string: no control characters, no lone surrogates."""
    if value is None:
        return default
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub("\ufffd", text).encode("utf-8", "replace").decode("utf-8")


def _esc(value: Any) -> str:
    return html.escape(_text(value), quote=True)


def fmt_duration(seconds: float) -> str:
    """``340ms``, ``12.3s``, ``3m05s``, ``1h02m``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


@dataclass
class _Phase:
    key: str
    start: float
    end: float
    open: bool = False  # no end recorded: drawn to the run's end
    failed: bool = False


@dataclass
class _Test:
    nodeid: str
    outcome: str
    start: float | None
    end: float | None


@dataclass
class _Launch:
    index: int
    raw: Mapping[str, Any]
    id: str
    label: str
    role: str
    outcome: str
    node: str
    gpus: list[int]
    gpu_names: dict[int, str]
    times: dict[str, float | None]
    tests: list[_Test]
    phases: list[_Phase] = field(default_factory=list)
    death: float | None = None

    @property
    def failed(self) -> bool:
        return self.outcome in FAILED_OUTCOMES

    @property
    def span(self) -> tuple[float, float] | None:
        return (self.phases[0].start, self.phases[-1].end) if self.phases else None

    @property
    def open(self) -> bool:
        return any(p.open for p in self.phases)

    def get(self, key: str, default: str = "") -> str:
        return _text(self.raw.get(key), default)

    def gpu_seconds(self, run_end: float) -> float:
        leased = self.times["t_leased"]
        if leased is None or not self.gpus:
            return 0.0
        end = next((t for t in (self.times["t_released"], self.times["t_stopped"]) if t is not None), run_end)
        return max(0.0, end - leased) * len(self.gpus)


def _parse_launch(index: int, raw: Mapping[str, Any]) -> _Launch:
    gpus: list[int] = []
    names: dict[int, str] = {}
    raw_gpus = raw.get("gpus")
    raw_names = raw.get("gpu_names")
    for i, gpu in enumerate(raw_gpus if isinstance(raw_gpus, list) else []):
        if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu not in gpus:
            gpus.append(gpu)
            if isinstance(raw_names, list) and i < len(raw_names) and raw_names[i] is not None:
                names[gpu] = _text(raw_names[i])
    tests = []
    raw_tests = raw.get("tests")
    for t in raw_tests if isinstance(raw_tests, list) else []:
        if isinstance(t, Mapping):
            start, end = _time(t.get("t_start")), _time(t.get("t_end"))
            tests.append(_Test(_text(t.get("nodeid"), "?"), _text(t.get("outcome"), "?"), start, end))
    return _Launch(index=index, raw=raw, id=_text(raw.get("id"), f"#{index}"), label=_text(raw.get("label"), "?"),
                   role=_text(raw.get("role"), "worker"), outcome=_text(raw.get("outcome"), "?"),
                   node=_text(raw.get("node")) or "local", gpus=sorted(gpus), gpu_names=names,
                   times={key: _time(raw.get(key)) for key in _TIME_KEYS}, tests=tests)


def _build_phases(launch: _Launch, run_end: float) -> None:
    times = launch.times
    prev_end: float | None = None
    for key, (start_key, end_key) in _PHASE_KEYS.items():
        start = times[start_key]
        end = times[end_key]
        if key == "teardown":
            if start is None and times["t_released"] is not None:
                start = times["t_stopped"]  # a death: the wait for the memory to come back
            end = end if end is not None else times["t_stopped"]
        elif end is None:
            later = _TIME_KEYS[_TIME_KEYS.index(end_key) + 1:]
            end = next((times[k] for k in later if times[k] is not None), None)
        if start is None:
            continue
        is_open = end is None
        start = max(start, prev_end) if prev_end is not None else start
        end = max(start, run_end if end is None else end)  # clock skew: clipped, never negative
        launch.phases.append(_Phase(key, start, end, open=is_open))
        prev_end = end
    if launch.failed:
        failed = [p for p in launch.phases if p.key == "startup"] or [p for p in launch.phases if p.key == "lease"]
        if failed:
            failed[-1].failed = True
    if launch.outcome == "died" and launch.phases:
        serving = [p for p in launch.phases if p.key == "serving"]
        death = times["t_stopped"] if times["t_stopped"] is not None else (serving or launch.phases)[-1].end
        launch.death = min(max(death, launch.phases[0].start), launch.phases[-1].end)


@dataclass
class _Lane:
    node: str
    gpu: int | None
    name: str = ""
    rows: list[list[_Launch]] = field(default_factory=list)

    @property
    def title(self) -> str:
        return "no GPU" if self.gpu is None else f"GPU {self.gpu}"


class _Run:
    """The report, normalized: launches with phases, lanes grouped by node, the run's time range and totals."""

    def __init__(self, report: Mapping[str, Any]) -> None:
        self.report = report
        raw = report.get("launches")
        items = [r for r in (raw if isinstance(raw, list) else []) if isinstance(r, Mapping)]
        self.launches = [_parse_launch(i, r) for i, r in enumerate(items)]
        self.interrupted = report.get("interrupted") is True
        started, finished = _time(report.get("started_at")), _time(report.get("finished_at"))
        stamps = [t for launch in self.launches for t in launch.times.values() if t is not None]
        stamps += [t for launch in self.launches for test in launch.tests for t in (test.start, test.end)
                   if t is not None]
        stamps += [t for t in (started, finished) if t is not None]
        self.t0 = min(stamps, default=0.0)
        self.t1 = max(stamps, default=self.t0)
        self.wall = max(0.0, (self.t1 if finished is None else finished) - (self.t0 if started is None else started))
        for launch in self.launches:
            _build_phases(launch, self.t1)
        by_key: dict[tuple[str, int | None], _Lane] = {}
        for launch in sorted((x for x in self.launches if x.span), key=lambda x: (x.span or (0, 0), x.index)):
            lane_gpus: list[int | None] = [*launch.gpus] or [None]
            for gpu in lane_gpus:
                lane = by_key.get((launch.node, gpu))
                if lane is None:
                    lane = by_key[(launch.node, gpu)] = _Lane(launch.node, gpu)
                lane.name = lane.name or (launch.gpu_names.get(gpu, "") if gpu is not None else "")
                _pack(lane.rows, launch)
        self.lanes = sorted(by_key.values(), key=lambda ln: (ln.node, ln.gpu is None, ln.gpu or 0))
        self.nodes = sorted({lane.node for lane in self.lanes})
        self.undrawn = sum(1 for x in self.launches if not x.span)

    def test_counts(self) -> dict[str, int]:
        """The tests as pytest's summary line counts them: the report's ``outcomes`` (pytest's own counts), else,
        for an older report, each test served once, in the worst outcome of its spans."""
        counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
        given = self.report.get("outcomes")
        if isinstance(given, Mapping):
            for key, value in given.items():
                number = _int(value)
                if key in _COUNTED and number is not None and number >= 0:
                    counts[key] = number
            return counts
        worst: dict[str, str] = {}
        for test in (t for x in self.launches for t in x.tests):
            ranks = [_WORST_FIRST.index(o) for o in (worst.get(test.nodeid), test.outcome) if o in _WORST_FIRST]
            worst[test.nodeid] = _WORST_FIRST[min(ranks)] if ranks else worst.get(test.nodeid, "")
        for outcome in worst.values():
            if outcome in _COUNT_KEYS:
                counts[_COUNT_KEYS[outcome]] = counts.get(_COUNT_KEYS[outcome], 0) + 1
        return counts

    def totals(self) -> dict[str, Any]:
        """The header's figures. ``tests``: the tests that used a worker, each once (a group's members and its
        router served the same test)."""
        return {"launches": len(self.launches),
                "failures": sum(1 for x in self.launches if x.failed),
                "deaths": sum(1 for x in self.launches if x.outcome == "died"),
                "interrupted": sum(1 for x in self.launches if x.outcome == "interrupted" or x.open),
                "tests": len({t.nodeid for x in self.launches for t in x.tests}), **self.test_counts(),
                "gpu_seconds": round(sum(x.gpu_seconds(self.t1) for x in self.launches), 1),
                "wall": self.wall, "lanes": len(self.lanes), "nodes": len(self.nodes)}


def _pack(rows: list[list[_Launch]], launch: _Launch) -> None:
    """First row whose last bar ends before this one starts (launches come sorted by start)."""
    start = (launch.span or (0.0, 0.0))[0]
    for row in rows:
        if (row[-1].span or (0.0, 0.0))[1] <= start:
            row.append(launch)
            return
    rows.append([launch])


def _phase_summary(launch: _Launch) -> str:
    parts = [f"{PHASE_NAMES[p.key]} {fmt_duration(p.end - p.start)}{'+ (no end recorded)' if p.open else ''}"
             for p in launch.phases]
    return " · ".join(parts) or "no times recorded"


def _details(launch: _Launch) -> dict[str, Any]:
    """What the hover text and the trace's ``args`` carry."""
    raw = launch.raw
    names = [launch.gpu_names.get(g, "") for g in launch.gpus]
    return {"launch": launch.id, "label": launch.label, "config": launch.get("config"),
            "model": launch.get("model"), "role": launch.role, "group": _text(raw.get("group")) or None,
            "xdist_worker": _text(raw.get("xdist_worker")) or None, "node": launch.node, "gpus": launch.gpus,
            "gpu_names": names if any(names) else [], "port": _int(raw.get("port")), "pid": _int(raw.get("pid")),
            "outcome": launch.outcome, "failure": _text(raw.get("failure")) or None,
            "diagnosis": _text(raw.get("diagnosis")) or None, "exit_code": _int(raw.get("exit_code")),
            "argv": launch.get("argv"), "log_path": _text(raw.get("log_path")) or None,
            "phases": _phase_summary(launch), "tests": [t.nodeid for t in launch.tests]}


def exit_text(code: int | None) -> str:
    """``1``, ``-9 (SIGKILL)``, ``-`` when unknown."""
    if code is None:
        return "-"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _diagnosis_text(d: Mapping[str, Any]) -> str:
    """The diagnosis and the failure line, once: a worker's failure line begins with its diagnosis."""
    diagnosis, failure = d["diagnosis"], d["failure"]
    if diagnosis and failure and diagnosis not in failure:
        return f"{diagnosis} ({failure})"
    return failure or diagnosis or ""


def _int_text(value: int | None) -> str:
    return "-" if value is None else str(value)


def _hover(launch: _Launch) -> str:
    d = _details(launch)
    gpus = ", ".join(str(g) for g in launch.gpus) or "none"
    if d["gpu_names"]:
        gpus += f" ({', '.join(d['gpu_names'])})"
    why = _diagnosis_text(d)
    lines = [f"{launch.label}  [{launch.role}]",
             f"outcome: {launch.outcome}" + (f" - {why}" if why else "")
             + (f" (exit {exit_text(d['exit_code'])})" if d["exit_code"] is not None else ""),
             f"launch {launch.id} · xdist worker {d['xdist_worker'] or 'main'} · node {launch.node}"
             + (f" · group {d['group']}" if d["group"] else ""),
             f"GPUs {gpus} · port {_int_text(d['port'])} · pid {_int_text(d['pid'])}",
             f"config {d['config']} · model {d['model']}", d["phases"],
             f"argv: {d['argv'] or '-'}", f"log: {d['log_path'] or '-'}", f"tests ({len(launch.tests)}):"]
    for test in launch.tests[:_HOVER_TESTS]:
        lines.append(f"  {test.nodeid}  {test.outcome}{_test_duration(test)}")
    if len(launch.tests) > _HOVER_TESTS:
        lines.append(f"  ... and {len(launch.tests) - _HOVER_TESTS} more (hover the marks)")
    return "\n".join(lines)


def _test_duration(test: _Test) -> str:
    return f" {fmt_duration(test.end - test.start)}" if test.start is not None and test.end is not None else ""


def _char_w(ch: str) -> float:
    """Width at 11px, sized for the wide sans faces (Verdana, DejaVu Sans), so narrower faces fit too."""
    if ch in "il.,:;'|!ijtfr ()[]-":
        return 4.2
    if ch in "mwMW@%" or ord(ch) > 0x2000:
        return 10.8
    return 8.0 if ch.isupper() or ch.isdigit() else 7.0


def truncate(text: str, width_px: float, char_w: Callable[[str], float] = _char_w) -> str:
    """``text`` cut (with an ellipsis) to what fits in ``width_px``; empty if not even the ellipsis fits."""
    total = 0.0
    for i, ch in enumerate(text):
        total += char_w(ch)
        if total > width_px:
            keep, room = text[:i], width_px - 7.0
            while keep and sum(char_w(c) for c in keep) > room:
                keep = keep[:-1]
            return keep + "…" if keep else ""
    return text


def _ticks(span: float, width: float) -> tuple[float, list[float]]:
    target = span * 90 / max(width, 1.0)  # one label per ~90 px at least
    nice = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900,
            1800, 3600, 7200, 10800, 21600, 43200, 86400]
    if target > nice[-1]:  # days: 1, 2, 5, 10, 20, 50, ... (the steps of the zoom levels nest, their ticks coincide)
        days = 10 ** math.floor(math.log10(target / 86400))
        nice = [86400 * days * m for m in (1, 2, 5, 10)]
    step = next(n for n in nice if n >= target)
    return step, [i * step for i in range(int(span / step) + 1)]


def fmt_tick(value: float, step: float) -> str:
    if step < 1:
        decimals = max(1, -math.floor(math.log10(step)))
        return f"{value:.{decimals}f}s"
    v = round(value)
    h, rest = divmod(v, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m" + (f"{s:02d}s" if s else "")
    if m:
        return f"{m}m" + (f"{s:02d}s" if s else "")
    return f"{s}s"


def _zoom_levels(span: float) -> list[int]:
    """Fit (1), then doubling until a second is :data:`_DENSITY` px wide on a :data:`_REF_W` px plot (at least
    up to 4x, at most :data:`_MAX_ZOOM`): a 13 s run gets 1, 2, 4; a 2-hour run up to 32."""
    levels = [1]
    while levels[-1] < _MAX_ZOOM and (levels[-1] < 4 or _REF_W * levels[-1] / max(span, 1e-6) < _DENSITY):
        levels.append(levels[-1] * 2)
    return levels


def _pct(value: float) -> str:
    """A percentage of the plot's width, as an SVG length."""
    text = f"{value:.4f}".rstrip("0").rstrip(".")
    return ("0" if text in ("", "-0") else text) + "%"


class _Svg:
    """The plot. Its horizontal coordinates are percentages of its width, so that the page lays the whole run
    out in the window's width (zoom "fit") or in a multiple of it (the zoom buttons widen the plot, which then
    scrolls sideways); its vertical ones are pixels. What depends on the width in pixels (the tick step, which
    bar labels have room enough) is worked out per zoom level for a :data:`_REF_W` px wide plot at "fit", and
    shown at its level by the page's CSS; bar labels are cut to their room by the browser (CSS ellipsis)."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.span = max(run.t1 - run.t0, 1e-6)
        self.levels = _zoom_levels(self.span)
        self.labels: list[str] = []

    def pos(self, t: float) -> float:
        """``t`` as a percentage of the plot's width."""
        return min(100.0, max(0.0, (t - self.run.t0) / self.span * 100))

    def x(self, t: float) -> str:
        return _pct(self.pos(t))

    def render(self) -> str:
        y = _AXIS_H
        body: list[str] = []
        for node in self.run.nodes:
            body.append(f'<g class="node" data-node="{_esc(node)}">')
            body.append(f'<rect class="node-band" x="0%" y="{y}" width="100%" height="{_NODE_H}"/>')
            self.labels.append(f'<g class="node-label"><rect x="0" y="{y}" width="{_LABEL_W}" height="{_NODE_H}"/>'
                               f'<text x="8" y="{y + 16}">{_esc(truncate("node " + node, _LABEL_W - 16))}'
                               f"<title>node {_esc(node)}</title></text></g>")
            y += _NODE_H
            for lane in (ln for ln in self.run.lanes if ln.node == node):
                body.append(self._lane(lane, y))
                y += len(lane.rows) * _ROW_H
            body.append("</g>")
        height = y + 6
        axis = self._axis(height)
        self.labels.insert(0, f'<svg class="lane-labels" width="{_LABEL_W}" height="{height}">')
        self.labels.append("</svg>")
        plot = [f'<svg id="plot" class="plot" width="100%" height="{height}" data-zoom-levels='
                f'"{" ".join(map(str, self.levels))}">', axis, *body, "</svg>"]
        return ('<div class="chart">' + "\n".join(self.labels)
                + '<div class="plot-scroll" tabindex="0" role="region" aria-label="the run\'s timeline (scrolls '
                'sideways when zoomed in)"><div class="plot-area">' + "\n".join(plot) + "</div></div></div>")

    def _axis(self, height: int) -> str:
        """The ticks of every zoom level, about 90 px apart or more at their level; a tick that several levels
        share is drawn once, with a class per level (``z1``, ``z2``, ...: the page shows those of its level)."""
        levels: dict[tuple[float, str], list[int]] = {}
        for zoom in self.levels:
            width = _REF_W * zoom
            step, ticks = _ticks(self.span, width)
            for value in ticks:
                room = (1 - value / self.span) * width  # a label centred near the right end would stick out
                levels.setdefault((round(value, 9), fmt_tick(value, step) if room >= 30 else ""), []).append(zoom)
        out = ['<g class="axis">']
        for (value, label), zooms in sorted(levels.items()):
            at = _pct(value / self.span * 100)
            text = f'<text x="{at}" y="{_AXIS_H - 10}">{label}</text>' if label else ""
            out.append(f'<g class="tick {" ".join(f"z{z}" for z in zooms)}"><line x1="{at}" y1="{_AXIS_H - 6}" '
                       f'x2="{at}" y2="{height}"/>{text}</g>')
        out.append("</g>")
        return "".join(out)

    def _lane(self, lane: _Lane, y: int) -> str:
        height = len(lane.rows) * _ROW_H
        gpu = "none" if lane.gpu is None else str(lane.gpu)
        name = f'<tspan class="gpu-name" x="8" dy="12">{_esc(truncate(lane.name, _LABEL_W - 16))}</tspan>' \
            if lane.name else ""
        self.labels.append(f'<g class="lane-label" data-node="{_esc(lane.node)}" data-gpu="{gpu}">'
                           f'<rect x="0" y="{y}" width="{_LABEL_W}" height="{height}"/>'
                           f'<text x="8" y="{y + 15}">{_esc(lane.title)}{name}</text></g>')
        out = [f'<g class="lane" data-node="{_esc(lane.node)}" data-gpu="{gpu}" data-rows="{len(lane.rows)}">',
               f'<rect class="lane-area" x="0%" y="{y}" width="100%" height="{height}"/>']
        for r, row in enumerate(lane.rows):
            for i, launch in enumerate(row):
                nxt = row[i + 1].span if i + 1 < len(row) else None
                out.append(self._bar(launch, lane, y + r * _ROW_H, self.pos(nxt[0]) if nxt else 100.0))
        out.append("</g>")
        return "\n".join(out)

    def _bar(self, launch: _Launch, lane: _Lane, y: int, room_end: float) -> str:
        start, end = launch.span or (0.0, 0.0)
        x0, x1 = self.pos(start), self.pos(end)
        top, gpu = y + _BAR_Y, "none" if lane.gpu is None else str(lane.gpu)
        raw = launch.raw
        attrs = (f'class="bar" data-launch="{_esc(launch.id)}" data-outcome="{_esc(launch.outcome)}" '
                 f'data-config="{_esc(raw.get("config"))}" data-role="{_esc(launch.role)}" '
                 f'data-xdist="{_esc(raw.get("xdist_worker") or "main")}" data-node="{_esc(launch.node)}" '
                 f'data-gpu="{gpu}" data-group="{_esc(raw.get("group") or "")}" data-open="{int(launch.open)}"')
        out = [f"<g {attrs}><title>{_esc(_hover(launch))}</title>"]
        for p in launch.phases:
            fill = FAILED_COLOUR if p.failed else PHASE_COLOURS[p.key]
            h, dy = (_BAR_H - 6, 3) if p.key == "lease" else (_BAR_H, 0)
            # the stroke of its own colour keeps a phase of a few milliseconds visible in a run of hours
            out.append(f'<rect class="phase" data-phase="{p.key}" data-failed="{int(p.failed)}" x="{self.x(p.start)}" '
                       f'y="{top + dy}" width="{_pct(self.pos(p.end) - self.pos(p.start))}" height="{h}" '
                       f'fill="{fill}" stroke="{fill}"/>')
        bad = launch.failed or launch.outcome == "died"
        if bad or launch.open or launch.outcome == "interrupted":
            colour, dash = (FAILED_COLOUR, "") if bad else (OPEN_COLOUR, ' stroke-dasharray="4 2"')
            out.append(f'<rect class="bar-outline" x="{_pct(x0)}" y="{top - 1}" width="{_pct(x1 - x0)}" '
                       f'height="{_BAR_H + 2}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for test in launch.tests:
            t_start = test.start if test.start is not None else test.end
            if t_start is None:
                continue
            t_end = max(t_start, test.end if test.end is not None else t_start)
            m0, m1 = self.pos(min(max(t_start, start), end)), self.pos(min(max(t_end, start), end))
            fill = TEST_COLOURS.get(test.outcome, _OTHER_TEST)
            out.append(f'<rect class="test-mark" data-outcome="{_esc(test.outcome)}" data-nodeid="{_esc(test.nodeid)}"'
                       f' x="{_pct(m0)}" y="{y + _MARK_Y}" width="{_pct(m1 - m0)}" height="{_MARK_H}" fill="{fill}"'
                       f' stroke="{fill}"><title>{_esc(test.nodeid)}\n{_esc(test.outcome)}{_test_duration(test)} '
                       f"on {_esc(launch.label)}</title></rect>")
        if launch.death is not None:
            dx = self.x(launch.death)
            out.append(f'<line class="death-mark" x1="{dx}" y1="{top - 3}" x2="{dx}" y2="{top + _BAR_H + 3}" '
                       f'stroke="{FAILED_COLOUR}" stroke-width="3"/>')
        if launch.open:
            out.append(f'<svg class="open-mark" x="{_pct(x1)}" y="{top}" width="8" height="{_BAR_H}" '
                       f'overflow="visible"><path d="M0 0 l7 {_BAR_H / 2} l-7 {_BAR_H / 2} z" fill="{OPEN_COLOUR}"/>'
                       "</svg>")
        out.append(self._label(launch, bad, x0, room_end, top))
        out.append("</g>")
        return "".join(out)

    def _label(self, launch: _Launch, bad: bool, x0: float, room_end: float, top: int) -> str:
        """The bar's label, in the room up to the next bar of its row (the browser cuts it there with an
        ellipsis); drawn from the first zoom level at which that room is :data:`_LABEL_MIN_W` px or more."""
        room = max(0.0, room_end - x0)
        level = next((z for z in self.levels if room / 100 * _REF_W * z >= _LABEL_MIN_W), None)
        if level is None:
            return ""
        tag = _OUTCOME_TAGS.get(launch.outcome) or ("no end recorded" if launch.open else "")
        role = f"[{launch.role}] " if launch.role != "worker" else ""
        xdist = _text(launch.raw.get("xdist_worker"))
        text = f"{'✕ ' if bad else ''}{tag + ' · ' if tag else ''}{role}{launch.label}{' · ' + xdist if xdist else ''}"
        cls = "bar-label bad" if bad else "bar-label"
        return (f'<foreignObject class="bar-label-box from-{level}" data-from-zoom="{level}" x="{_pct(x0)}" '
                f'y="{top}" width="{_pct(room)}" height="{_BAR_H}"><div class="{cls}" '
                f'>{_esc(text[:_LABEL_MAX_CHARS])}</div></foreignObject>')


_CSS = """
:root{color-scheme:light}
body{margin:16px 20px;font:13px/1.4 Verdana,"DejaVu Sans","Segoe UI",Arial,sans-serif;color:#1d232a;background:#fff}
h1{font-size:18px;margin:0 0 6px}
.summary{margin:4px 0 8px}.stat{display:inline-block;margin-right:14px}.stat b{font-size:15px}
.bad{color:#d62839}.muted{color:#5c6670}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0 10px;font-size:12px}
.legend-item{display:inline-flex;align-items:center;gap:5px}.sw{display:inline-block}
.zoom{position:relative;display:flex;flex-wrap:wrap;align-items:center;gap:4px;margin:0 0 8px;font-size:12px}
.zoom-title{font-weight:bold;margin-right:4px}
.zoom input{position:absolute;left:0;top:0;opacity:0;width:1px;height:1px;margin:0}
.zoom label{border:1px solid #aeb6bf;border-radius:3px;padding:1px 8px;cursor:pointer;background:#f7f8fa}
.zoom input:checked+label{background:#1d232a;border-color:#1d232a;color:#fff}
.zoom input:focus-visible+label{outline:2px solid #2f6fb6;outline-offset:1px}
.zoom .muted{margin-left:8px}
.chart{display:flex;border:1px solid #d5dae0;border-radius:4px;background:#fff}
.plot-scroll{overflow-x:auto;flex:1;min-width:0}.plot-area{width:100%;padding:0 14px;box-sizing:border-box}
svg{font:11px Verdana,"DejaVu Sans","Segoe UI",Arial,sans-serif;display:block}svg.plot{overflow:visible}
.lane-labels{flex:none;border-right:1px solid #d5dae0}
.lane-label rect{fill:#f7f8fa;stroke:#e3e7eb}.lane-label text{font-size:12px;font-weight:bold;fill:#1d232a}
.gpu-name{font-size:10px;font-weight:normal;fill:#5c6670}
.node-label text{font-size:12px;font-weight:bold;fill:#1d232a}.node-label rect,.node-band{fill:#e2e7ec}
.node-band,.lane-area{x:-14px;width:calc(100% + 28px)}
.lane-area{fill:none;stroke:#e3e7eb}.tick line{stroke:#e6e9ed}.tick text{fill:#5c6670;text-anchor:middle}
.tick{display:none}.tick.z1{display:inline}.phase,.test-mark{stroke-width:1px}
.bar-label-box{pointer-events:none;overflow:hidden}.bar-label-box:not(.from-1){display:none}
.bar-label{font:11px/18px Verdana,"DejaVu Sans","Segoe UI",Arial,sans-serif;color:#14181c;padding:0 4px;
white-space:nowrap;overflow:hidden;text-overflow:ellipsis;
text-shadow:0 0 2px #fff,0 0 2px #fff,0 0 1px #fff}
.bar-label.bad{color:#b01e2f;font-weight:bold}.bar:hover .phase{filter:brightness(.9)}
.table-wrap{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;font-size:12px;margin-top:6px;max-width:100%}
td,th{border:1px solid #d5dae0;padding:2px 6px;text-align:left;vertical-align:top}
td.long{overflow-wrap:anywhere;min-width:8em}td.short{white-space:nowrap}
th{background:#f1f3f5}
section,details{margin-top:14px}summary{cursor:pointer;font-weight:bold}h2{font-size:15px;margin:0}
.failure-line{max-width:60em}
"""


def _zoom_css(levels: Sequence[int]) -> str:
    """The zoom levels, in CSS alone: the checked button widens the plot, shows its ticks and the labels that
    have room at that level."""
    rules = []
    for zoom in levels[1:]:
        on = f"body:has(#zoom-{zoom}:checked)"
        rules.append(f"{on} .plot-area{{width:{zoom * 100}%}}{on} .tick.z1{{display:none}}"
                     f"{on} .tick.z{zoom}{{display:inline}}"
                     + "".join(f"{on} .bar-label-box.from-{z}{{display:inline}}" for z in levels[1:] if z <= zoom))
    return "\n".join(rules)


def _zoom_control(levels: Sequence[int]) -> str:
    """Radio buttons (Tab to them, then the arrow keys), no script: "fit" lays the whole run out in the window's
    width; each level doubles it, and the plot scrolls sideways."""
    buttons = "".join(
        f'<input type="radio" name="zoom" id="zoom-{z}" value="{z}"{" checked" if z == 1 else ""}>'
        f'<label for="zoom-{z}" title="{"the whole run in the window" if z == 1 else f"{z} times wider"}">'
        f'{"fit" if z == 1 else f"{z}&times;"}</label>' for z in levels)
    return (f'<div id="zoom" class="zoom" role="radiogroup" aria-labelledby="zoom-title">'
            f'<span id="zoom-title" class="zoom-title">zoom</span>{buttons}'
            '<span class="muted">arrow keys change it; zoomed in, the plot scrolls sideways</span></div>')


def _legend() -> str:
    def rect(fill: str, y: float = 2, h: float = 12, extra: str = "") -> str:
        return f'<rect x="2" y="{y}" width="26" height="{h}" fill="{fill}"{extra}/>'

    serving = PHASE_COLOURS["serving"]
    items = [(key, name, rect(PHASE_COLOURS[key], *((5, 6) if key == "lease" else ())))
             for key, name in PHASE_NAMES.items()]
    items += [("failed", "failed start", rect(FAILED_COLOUR)),
              ("died", "died (│ marks the death)", rect(serving, extra=f' stroke="{FAILED_COLOUR}" stroke-width="2"')
               + f'<rect x="17" y="0" width="3" height="16" fill="{FAILED_COLOUR}"/>'),
              ("open", "no end recorded: drawn to the run's end",
               rect(serving, extra=f' stroke="{OPEN_COLOUR}" stroke-width="2" stroke-dasharray="4 2"')
               + f'<path d="M28 2 l6 6 l-6 6 z" fill="{OPEN_COLOUR}"/>')]
    items += [(f"test-{o}", f"test {o}", rect(c, 6, 5)) for o, c in TEST_COLOURS.items()]
    return '<div id="legend" class="legend">' + "".join(
        f'<span class="legend-item" data-key="{key}"><svg class="sw" width="36" height="16">{svg}</svg>'
        f"{_esc(name)}</span>" for key, name, svg in items) + "</div>"


def _clock(t: float | None) -> str:
    with contextlib.suppress(OverflowError, OSError, ValueError):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t is not None else "-"
    return "-"


def _header(run: _Run) -> str:
    tot = run.totals()
    report = run.report
    # the tests as pytest's summary line counts them (a test whose call passed and whose teardown failed is one
    # passed and one error, as there); other categories when there are any
    counts = [(tot[k], k, k in ("failed", "errors") and tot[k] > 0) for k in _COUNTED
              if k in tot and (tot[k] or k in ("passed", "failed", "errors", "skipped"))]
    stats = [(tot["launches"], "launches", False), (tot["failures"], "startup failures", tot["failures"] > 0),
             (tot["deaths"], "deaths", tot["deaths"] > 0), (tot["tests"], "tests served", False), *counts,
             (fmt_duration(tot["wall"]), "wall", False), (tot["gpu_seconds"], "GPU-seconds", False),
             (tot["lanes"], "lanes", False)]
    attrs = " ".join(f'data-{k.replace("_", "-")}="{_esc(v)}"' for k, v in tot.items())
    models = report.get("models")
    meta = [f"started {_clock(_time(report.get('started_at')))}", f"engine {_esc(report.get('engine') or '-')}",
            f"models {_esc(', '.join(_text(m) for m in models) if isinstance(models, list) else '-')}",
            f"exit status {_esc(report.get('exitstatus', '-'))}"]
    out = ["<header><h1>sglang workers: run timeline</h1>",
           f'<div class="muted">{" · ".join(meta)}</div>', f'<div id="summary" class="summary" {attrs}>']
    out += [f'<span class="stat{" bad" if bad else ""}"><b>{_esc(v)}</b> {name}</span>' for v, name, bad in stats]
    if run.interrupted:
        out.append('<span class="stat bad"><b>interrupted</b> run: unfinished bars end at the run\'s end (▸)</span>')
    out.append("</div>")
    out.append(_legend())
    out.append("</header>")
    return "".join(out)


_LONG_COLUMNS = frozenset({"config", "diagnosis", "log", "last test"})  # wrapped anywhere: the table fits the window


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], attrs: Sequence[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    cls = ["long" if h in _LONG_COLUMNS else "short" for h in headers]
    body = "".join(f"<tr {a}>" + "".join(f'<td class="{c}">{v}</td>' for c, v in zip(cls, row, strict=True))
                   + "</tr>" for a, row in zip(attrs, rows, strict=True))
    return f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _listed(run: _Run) -> list[_Launch]:
    """The launches the failures table lists: failed starts, deaths, unfinished ones, and the members cancelled
    because another member of their group failed to start."""
    failed_groups = {_text(x.raw.get("group")) for x in run.launches if x.failed and x.raw.get("group")}
    return [x for x in run.launches if x.failed or x.outcome in ("died", "interrupted") or x.open
            or (x.outcome == "cancelled" and _text(x.raw.get("group")) in failed_groups)]


def _tables(run: _Run) -> str:
    out = []
    bad = _listed(run)
    if bad:
        rows = []
        for x in bad:
            d = _details(x)
            last = next((t for t in reversed(x.tests)), None)
            test = f'<span title="{_esc(last.nodeid)}">{_esc(truncate(last.nodeid, 420))}</span>' if last else "-"
            rows.append([_esc(x.id), f'<b class="bad">{_esc(x.outcome)}</b>', _esc(x.label),
                         _esc(", ".join(map(str, x.gpus)) or "-"), _esc(x.raw.get("xdist_worker") or "main"),
                         f'<span class="failure-line">{_esc(_diagnosis_text(d) or "-")}</span>',
                         _esc(exit_text(d["exit_code"])), _esc(d["log_path"] or "-"), test])
        out.append(f'<section id="failures"><h2 class="bad">Failed, dead or unfinished launches ({len(bad)})</h2>'
                   + _table(["launch", "outcome", "config", "GPUs", "xdist", "diagnosis", "exit", "log",
                             "last test"], rows, [f'class="failure" data-launch="{_esc(x.id)}"' for x in bad])
                   + "</section>")
    rows = []
    for x in run.launches:
        durations = {p.key: fmt_duration(p.end - p.start) + ("+" if p.open else "") for p in x.phases}
        rows.append([_esc(x.id), _esc(x.label), _esc(x.role), _esc(x.node), _esc(", ".join(map(str, x.gpus)) or "-"),
                     _esc(x.raw.get("xdist_worker") or "main"), _esc(_int_text(_int(x.raw.get("port")))),
                     _esc(x.outcome), *(durations.get(k, "-") for k in PHASE_NAMES), str(len(x.tests))])
    out.append(f'<details id="launches"><summary>All launches ({len(run.launches)})</summary>'
               + _table(["launch", "config", "role", "node", "GPUs", "xdist", "port", "outcome",
                         *PHASE_NAMES.values(), "tests"], rows,
                        [f'class="launch-row" data-launch="{_esc(x.id)}"' for x in run.launches]) + "</details>")
    return "".join(out)


def render_html(report: Mapping[str, Any]) -> str:
    """The timeline page (``--sgl-timeline``): one self-contained HTML document that fetches nothing."""
    run = _Run(report)
    zoom = ""
    if run.lanes:
        svg = _Svg(run)
        chart = _zoom_control(svg.levels) + svg.render()
        zoom = _zoom_css(svg.levels)
        if run.undrawn:
            chart += f'<p class="muted">{run.undrawn} launches without any recorded time are not drawn.</p>'
    else:
        chart = '<p id="empty" class="empty">no worker was launched</p>' if not run.launches else \
            '<p id="empty" class="empty">no launch has a recorded time</p>'
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<link rel=\"icon\" href=\"data:,\">\n<title>sglworker timeline</title>\n"
            f"<style>{_CSS}{zoom}</style></head>\n<body>\n{_header(run)}\n<main>\n{chart}\n"
            f"{_tables(run) if run.launches else ''}\n</main>\n</body></html>\n")


def trace_events(report: Mapping[str, Any]) -> dict[str, Any]:
    """The same launches as Chrome trace-event JSON (``--sgl-trace``), for Perfetto and ``chrome://tracing``.

    A process per node, a thread per GPU lane row; per launch a complete event (``X``) spanning it, its phases
    nested inside, and its tests nested in the phase they overlap most (clipped to it; ``args`` keep the real
    times); instant events (``i``) for deaths, failed starts and unfinished ends. Times in microseconds since
    the run's start."""
    run = _Run(report)

    def us(t: float) -> int:
        return round((t - run.t0) * 1e6)

    events: list[dict[str, Any]] = []
    for pid, node in enumerate(run.nodes, 1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"node {node}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tid = 0
        for lane in (ln for ln in run.lanes if ln.node == node):
            for r, row in enumerate(lane.rows):
                tid += 1
                name = lane.title + (f" ({lane.name})" if lane.name else "") + (f" #{r + 1}" if r else "")
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
                for launch in row:
                    events += _trace_launch(launch, pid, tid, us, run.t1)
    if run.interrupted:
        events.append({"name": "run interrupted", "ph": "i", "s": "g", "pid": 1, "tid": 0, "ts": us(run.t1),
                       "args": {}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": _text(report.get("schema")), "ts_zero_epoch": run.t0,
                          "generator": "pytest-sglworker"}}


def _trace_launch(launch: _Launch, pid: int, tid: int, us: Callable[[float], int], run_end: float,
                  ) -> list[dict[str, Any]]:
    args = _details(launch)
    start, end = launch.span or (0.0, 0.0)
    out = [{"name": f"{launch.label} [{launch.role}]", "cat": "launch", "ph": "X", "pid": pid, "tid": tid,
            "ts": us(start), "dur": us(end) - us(start), "args": args}]
    spans = [(us(p.start), us(p.end)) for p in launch.phases]
    for p, (s, e) in zip(launch.phases, spans, strict=True):
        name = PHASE_NAMES[p.key] + (" (failed)" if p.failed else "") + (" (no end recorded)" if p.open else "")
        out.append({"name": name, "cat": p.key, "ph": "X", "pid": pid, "tid": tid, "ts": s, "dur": e - s,
                    "args": {"launch": launch.id, "seconds": round(p.end - p.start, 6), "open": p.open}})
    last_end = [s for s, _ in spans]  # per phase: where the next test may start, so that tests never overlap
    for test in launch.tests:
        t_start = test.start if test.start is not None else test.end
        if t_start is None or not spans:
            continue
        ts_, te_ = us(t_start), us(max(t_start, test.end if test.end is not None else t_start))
        overlap = [min(te_, e) - max(ts_, s) for s, e in spans]
        best = max(range(len(spans)), key=lambda i: (overlap[i], -abs(ts_ - spans[i][0]), i))
        s, e = spans[best]
        a = min(max(ts_, s, last_end[best]), e)
        b = min(max(te_, a), e)
        last_end[best] = b
        out.append({"name": test.nodeid, "cat": "test", "ph": "X", "pid": pid, "tid": tid, "ts": a, "dur": b - a,
                    "args": {"outcome": test.outcome, "launch": launch.id, "t_start_us": ts_,
                             "seconds": None if test.end is None else round(max(0.0, test.end - t_start), 6)}})
    marks = []
    if launch.death is not None:
        marks.append((f"died: {launch.label}", launch.death))
    if launch.failed:
        failed = [p for p in launch.phases if p.failed]
        marks.append((f"{launch.outcome}: {launch.label}", failed[-1].end if failed else end))
    if launch.open:
        marks.append((f"no end recorded: {launch.label}", run_end))
    for name, t in marks:
        out.append({"name": name, "cat": "outcome", "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": us(t),
                    "args": {"launch": launch.id, "outcome": launch.outcome, "failure": args["failure"]}})
    return out


def _write_atomically(path: str | os.PathLike[str], text: str) -> None:
    from ..resources.state import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(path), text)


def write_html(path: str | os.PathLike[str], report: Mapping[str, Any]) -> None:
    """``--sgl-timeline PATH``: :func:`render_html`, written atomically (temp file + rename), mode 0644."""
    _write_atomically(path, render_html(report))


def write_trace(path: str | os.PathLike[str], report: Mapping[str, Any]) -> None:
    """``--sgl-trace PATH``: :func:`trace_events` as JSON, written atomically (temp file + rename), mode 0644."""
    _write_atomically(path, json.dumps(trace_events(report), allow_nan=False, separators=(",", ":")) + "\n")
