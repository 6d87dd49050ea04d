"""The run's timeline (``pytest_sglworker.plugin.timeline``): the HTML page and the Chrome trace, from synthetic
reports.

Pure and fast: no pytest session, no browser (``tests/plugin/test_timeline_browser.py`` renders the page in chromium).
``python tests/plugin/test_timeline.py`` rewrites ``tests/data/timeline/sample_report.json`` from :func:`sample_report`.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import random
import re
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.plugin import timeline
from pytest_sglworker.plugin.timeline import FAILED_COLOUR, PHASE_COLOURS, TEST_COLOURS, render_html, trace_events

T0 = 1_733_150_000.0
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "timeline" / "sample_report.json"
EVIL = '<script>alert("x")</script>&<u>'
LONG_LABEL = "llama-1b --max-total-tokens 4096 --chunked-prefill-size 2048 --enable-metrics"
NO_TIMES: dict[str, Any] = dict.fromkeys(timeline._TIME_KEYS)


# -- a builder of synthetic reports -----------------------------------------------------------------------------

def launch(lid: str, *, at: float = 0.0, gpus: Sequence[int] = (0,), lease_wait: float = 0.5, startup: float = 3.0,
           serve: float = 20.0, teardown: float = 1.0, tests: int | Sequence[Mapping[str, Any]] = 2,
           test_outcome: str = "passed", **fields: Any) -> dict[str, Any]:
    """One launch record; ``fields`` override any key (None drops a time). Tests are spread over serving."""
    req = T0 + at
    leased = req + lease_wait
    started = leased + 0.05
    ready = started + startup
    stop = ready + serve
    record: dict[str, Any] = {
        "id": lid, "config": "qwen3-0.6b", "label": "qwen3-0.6b", "model": "Qwen/Qwen3-0.6B", "role": "worker",
        "group": None, "xdist_worker": "gw0", "node": "node-a", "gpus": list(gpus),
        "gpu_names": [f"sim-gpu-{g}" for g in gpus], "port": 20000 + 4 * int(at), "pid": 4000 + int(at),
        "argv": f"python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port {20000 + 4 * int(at)}",
        "log_path": f"/tmp/logs/sglang-worker-{lid}.log", "t_lease_requested": req, "t_leased": leased,
        "t_started": started, "t_ready": ready, "t_stop_requested": stop, "t_stopped": stop + teardown * 0.7,
        "t_released": stop + teardown, "outcome": "ok", "failure": None, "tests": []}
    if isinstance(tests, int):
        step = serve / max(tests, 1)
        record["tests"] = [{"nodeid": f"tests/test_e2e.py::test_{lid}_{i}[qwen3-0.6b]", "t_start": ready + i * step,
                            "t_end": ready + (i + 0.8) * step, "outcome": test_outcome} for i in range(tests)]
    else:
        record["tests"] = [dict(t) for t in tests]
    record.update(fields)
    return record


def report(*launches: Mapping[str, Any], started: float | None = T0 - 1, finished: float | None = None,
           interrupted: bool = False) -> dict[str, Any]:
    ends = [t for r in launches for k, t in r.items() if k.startswith("t_") and isinstance(t, float)]
    return {"schema": "pytest-sglworker/report/v1", "engine": "sim", "models": ["qwen3-0.6b"], "exitstatus": 0,
            "workers": {}, "started_at": started, "interrupted": interrupted,
            "finished_at": finished if finished is not None else (max(ends, default=T0) + 1 if not interrupted
                                                                   else None),
            "launches": [dict(r) for r in launches]}


OOM = "CUDA out of memory while capturing the prefill CUDA graph"
KILLED = "killed by SIGKILL with no error in the log (likely the host OOM killer)"
KV_OOM = "the loaded weights leave no GPU memory for the KV cache"


def sample_report() -> dict[str, Any]:
    """A run with everything: 2 nodes, 8 GPUs, labels cut short by the next bar, a tp=2 worker, a PD group with
    its router, a queued lease, a failed start (on its GPU, with its log and diagnosis), a PD group whose prefill
    member failed to start and whose decode member was cancelled for it, a death during a test (with its
    diagnosis), an unfinished worker of an interrupted run, hostile strings, and pytest's counts of the tests."""
    pd: dict[str, Any] = {"group": "gw2-pd-1", "config": "qwen3-pd", "label": "qwen3-0.6b pd"}
    pd_failed: dict[str, Any] = {"group": "gw2-pd-2", "config": "qwen3-pd-long", "label": "qwen3-0.6b pd long",
                                 "node": "node-b", "xdist_worker": "gw2", "startup": 3.0, "serve": 0,
                                 "t_ready": None, "t_stop_requested": None,
                                 "tests": [{"nodeid": "tests/test_pd.py::test_pd_long[qwen3-0.6b]",
                                            "t_start": T0 + 21.5, "t_end": T0 + 25.4, "outcome": "error"}]}
    death_at = T0 + 40 + 0.55 + 2.5 + 9.0
    launches = [
        launch("gw0-1", at=0, gpus=(0,), serve=30, tests=6, label="qwen3-0.6b --max-total-tokens 512"),
        launch("gw0-2", at=36, gpus=(0,), serve=16, tests=[
            {"nodeid": "tests/test_e2e.py::test_stream[qwen3-0.6b]", "t_start": T0 + 41, "t_end": T0 + 44,
             "outcome": "passed"},
            {"nodeid": "tests/test_e2e.py::test_long_prompt[qwen3-0.6b]", "t_start": T0 + 44.2, "t_end": T0 + 50,
             "outcome": "failed"}]),
        launch("gw0-3", at=58, gpus=(0,), startup=5.5, serve=0, tests=[
            {"nodeid": "tests/test_faults.py::test_oom[qwen3-0.6b]", "t_start": T0 + 57.8, "t_end": T0 + 64.2,
             "outcome": "error"}], outcome="startup_failed", t_ready=None, t_stop_requested=None,
            diagnosis=OOM, exit_code=-9, failure=f"{OOM} (worker qwen3-0.6b on 127.0.0.1:20232 (pid 4058, GPUs 0) "
                                                 "exited during startup with code -9 (SIGKILL) after 5.5 s)"),
        launch("gw1-1", at=2, gpus=(2, 3), startup=6, serve=38, tests=9, xdist_worker="gw1", config="llama-8b-tp2",
               label="llama-8b tp=2", model="meta-llama/Llama-3.1-8B-Instruct"),
        launch("gw1-2", at=40, gpus=(1,), startup=2.5, serve=9.2, tests=[
            {"nodeid": "tests/test_router.py::test_retry_on_dead_worker[qwen3-0.6b]", "t_start": T0 + 49,
             "t_end": T0 + 52.4, "outcome": "error"}], xdist_worker="gw1", outcome="died", t_stopped=death_at,
            t_stop_requested=death_at + 0.2, t_released=death_at + 1.0, diagnosis=KILLED, exit_code=-9,
            failure=f"{KILLED} (worker qwen3-0.6b on 127.0.0.1:20160 (pid 4040, GPUs 1) exited with code -9 "
                    "(SIGKILL))"),
        launch("gw2-5", at=18, gpus=(2,), role="prefill", outcome="startup_failed", diagnosis=KV_OOM, exit_code=1,
               failure=f"{KV_OOM} (worker qwen3-0.6b (prefill 0) on 127.0.0.1:20072 (pid 4018, GPUs 2) exited "
                       "during startup with code 1 after 3.0 s)", **pd_failed),
        launch("gw2-6", at=18, gpus=(3,), role="decode", outcome="cancelled", log_path=None,
               failure="stopped while starting: member prefill 0 of its group failed to start", **pd_failed),
        launch("gw1-3", at=3, gpus=(1,), startup=2, serve=8, tests=3, xdist_worker="gw1", label=LONG_LABEL),
        launch("gw1-4", at=15, gpus=(1,), startup=2, serve=12, tests=4, xdist_worker="gw1", label=LONG_LABEL),
        launch("gw0-4", at=34, gpus=(0,), lease_wait=5.5, serve=0.5, tests=1, xdist_worker="gw0",
               label="qwen3-0.6b fresh"),
        launch("gw2-1", at=4, gpus=(0,), node="node-b", serve=26, tests=5, xdist_worker="gw2", role="prefill", **pd),
        launch("gw2-2", at=4, gpus=(1,), node="node-b", serve=26, tests=5, xdist_worker="gw2", role="decode", **pd),
        launch("gw2-3", at=4.2, gpus=(), node="node-b", startup=3.4, serve=26, tests=5, xdist_worker="gw2",
               role="router", **{**pd, "gpu_names": []}),
        launch("gw2-4", at=38, gpus=(0, 1), node="node-b", startup=4, serve=30, tests=7, xdist_worker="gw2",
               label="qwen3-0.6b " + EVIL, argv="python -m sglang.launch_server " + EVIL,
               t_stop_requested=None, t_stopped=None, t_released=None, outcome="interrupted",
               log_path="/tmp/logs/" + EVIL),
    ]
    launches[-1]["tests"][-1]["nodeid"] = "tests/test_e2e.py::test_escape[" + EVIL + "-" + "x" * 300 + "]"
    launches[-1]["tests"][-1]["t_end"] = None
    rep = report(*launches, interrupted=True)
    rep["finished_at"] = T0 + 80.0
    # pytest's counts: every test served once in its outcome, and the worker test that died during its call
    # (test_retry_on_dead_worker) counted as pytest counts it: its call passed, its teardown failed
    rep["outcomes"] = {"passed": 47, "failed": 1, "errors": 3, "skipped": 0}
    return rep


# -- a small DOM over the HTML, for queries ---------------------------------------------------------------------

class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Element] = []
        self.texts: list[str] = []

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    def text(self) -> str:
        return "".join(self.texts) + "".join(c.text() for c in self.children if c.tag != "title")

    def title(self) -> str:
        return next((c.text_all() for c in self.children if c.tag == "title"), "")

    def text_all(self) -> str:
        return "".join(self.texts) + "".join(c.text_all() for c in self.children)

    def iter(self) -> Iterator[Element]:
        for child in self.children:
            yield child
            yield from child.iter()

    def find(self, cls: str | None = None, tag: str | None = None, **data: str) -> list[Element]:
        return [e for e in self.iter() if (cls is None or cls in e.classes) and (tag is None or e.tag == tag)
                and all(e.attrs.get("data-" + k.replace("_", "-")) == v for k, v in data.items())]


class Dom(HTMLParser):
    VOID = {"meta", "link", "br", "img", "input", "hr"}

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Element("#root", {}, None)
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(element)
        if tag not in self.VOID:
            self.cur = element

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.cur.children.append(Element(tag, {k: v or "" for k, v in attrs}, self.cur))

    def handle_endtag(self, tag: str) -> None:
        node: Element | None = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        assert node is not None and node.parent is not None, f"unbalanced </{tag}>"
        self.cur = node.parent

    def handle_data(self, data: str) -> None:
        self.cur.texts.append(data)

    def find(self, cls: str | None = None, tag: str | None = None, **data: str) -> list[Element]:
        return self.root.find(cls, tag, **data)


def dom(rep: Mapping[str, Any]) -> Dom:
    return Dom(render_html(rep))


def phase_fills(bar: Element) -> dict[str, str]:
    return {r.attrs["data-phase"]: r.attrs["fill"] for r in bar.find("phase")}


def pct(value: str) -> float:
    """An SVG length of the plot: a percentage of its width."""
    assert value.endswith("%"), value
    return float(value[:-1])


# -- a validator of Chrome trace-event JSON ---------------------------------------------------------------------

def check_trace(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What Perfetto and chrome://tracing need; returns the events."""
    json.dumps(trace, allow_nan=False)
    assert set(trace) >= {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert isinstance(events, list)
    named_procs, named_threads = set(), set()
    for ev in events:
        assert isinstance(ev["name"], str) and ev["ph"] in {"X", "M", "i"}, ev
        assert type(ev["pid"]) is int and type(ev["tid"]) is int and ev["pid"] > 0, ev
        assert isinstance(ev.get("args", {}), dict)
        if ev["ph"] == "M":
            assert ev["name"] in {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}
            if ev["name"] == "process_name":
                named_procs.add(ev["pid"])
            if ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert type(ev["ts"]) is int and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert type(ev["dur"]) is int and ev["dur"] >= 0, ev
        else:
            assert ev["s"] in {"t", "p", "g"}, ev
    for ev in events:
        if ev["ph"] != "M":
            assert ev["pid"] in named_procs, ev
            if ev["ph"] == "X" or ev.get("s") == "t":
                assert (ev["pid"], ev["tid"]) in named_threads, ev
    # complete events of one thread nest properly (no partial overlap)
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in events:
        if ev["ph"] == "X":
            by_thread.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for evs in by_thread.values():
        stack: list[int] = []
        for ev in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= ev["ts"]:
                stack.pop()
            end = ev["ts"] + ev["dur"]
            assert not stack or end <= stack[-1], f"improperly nested: {ev['name']}"
            stack.append(end)
    return events


def xs(events: Sequence[Mapping[str, Any]], cat: str) -> list[Mapping[str, Any]]:
    return [e for e in events if e["ph"] == "X" and e.get("cat") == cat]


# -- HTML ----------------------------------------------------------------------------------------------------

def test_lanes_one_per_gpu_per_node_grouped_by_node() -> None:
    rep = report(launch("a", gpus=(3,)), launch("b", gpus=(0,), at=1), launch("c", gpus=(1,), node="node-b"),
                 launch("d", gpus=(0,), node="node-b", at=30), launch("e", gpus=(), node="node-b", role="router"))
    d = dom(rep)
    lanes = [(e.attrs["data-node"], e.attrs["data-gpu"]) for e in d.find("lane")]
    assert lanes == [("node-a", "0"), ("node-a", "3"), ("node-b", "0"), ("node-b", "1"), ("node-b", "none")]
    assert [e.attrs["data-node"] for e in d.find("node")] == ["node-a", "node-b"]
    assert [e.text().strip() for e in d.find("lane-label")][:2] == ["GPU 0sim-gpu-0", "GPU 3sim-gpu-3"]
    assert len(d.find("bar")) == 5
    node_b = d.find("node", node="node-b")[0]
    assert {b.attrs["data-launch"] for b in node_b.find("bar")} == {"c", "d", "e"}


def test_tp2_launch_is_drawn_in_each_of_its_lanes() -> None:
    d = dom(report(launch("tp2", gpus=(1, 0), tests=3), launch("solo", gpus=(2,))))
    bars = d.find("bar", launch="tp2")
    assert sorted(b.attrs["data-gpu"] for b in bars) == ["0", "1"]
    for lane in d.find("lane"):
        assert len(lane.find("bar")) == 1
    assert len(d.find("test-mark")) == 3 * 2 + 2
    assert "GPUs 0, 1 (sim-gpu-1, sim-gpu-0)" not in bars[0].title()  # GPUs sorted, names kept with them
    assert "GPUs 0, 1 (sim-gpu-0, sim-gpu-1)" in bars[0].title()


def test_pd_group_members_and_router_lane() -> None:
    g: dict[str, Any] = {"group": "pd-7", "config": "qwen-pd"}
    d = dom(report(launch("p", role="prefill", gpus=(0,), **g), launch("d", role="decode", gpus=(1,), **g),
                   launch("r", role="router", gpus=(), gpu_names=[], **g)))
    router = d.find("bar", launch="r")[0]
    assert router.attrs["data-gpu"] == "none" and router.parent is not None
    assert router.parent.attrs["data-gpu"] == "none"
    assert [e.text() for e in d.find("lane-label", gpu="none")] == ["no GPU"]
    assert {b.attrs["data-role"] for b in d.find("bar", group="pd-7")} == {"prefill", "decode", "router"}
    assert d.find("bar-label", tag="div")[0].text() == "[prefill] qwen3-0.6b · gw0"
    assert "group pd-7" in router.title() and "[router]" in router.title()


def test_startup_failure_stands_out() -> None:
    rep = report(launch("ok"), launch("bad", gpus=(1,), t_ready=None, t_stop_requested=None, tests=[
        {"nodeid": "t.py::test_x", "t_start": T0 + 0.1, "t_end": T0 + 3.6, "outcome": "error"}],
        outcome="startup_failed", failure="CUDA out of memory while capturing the prefill CUDA graph"))
    d = dom(rep)
    ok, bad = d.find("bar", launch="ok")[0], d.find("bar", launch="bad")[0]
    assert phase_fills(ok) == {k: PHASE_COLOURS[k] for k in ("lease", "startup", "serving", "teardown")}
    assert phase_fills(bad) == {"lease": PHASE_COLOURS["lease"], "startup": FAILED_COLOUR,
                                "teardown": PHASE_COLOURS["teardown"]}
    assert FAILED_COLOUR not in PHASE_COLOURS.values()
    assert not ok.find("bar-outline") and bad.find("bar-outline")[0].attrs["stroke"] == FAILED_COLOUR
    assert "startup failed" in bad.find("bar-label")[0].text()
    assert bad.find("test-mark")[0].attrs["fill"] == TEST_COLOURS["error"]
    assert "outcome: startup_failed - CUDA out of memory" in bad.title()
    rows = d.find("failure", tag="tr")
    assert [r.attrs["data-launch"] for r in rows] == ["bad"]
    assert "CUDA out of memory" in rows[0].text()
    assert d.find(tag="div", cls="summary")[0].attrs["data-failures"] == "1"


def test_death_during_a_test() -> None:
    died_at = T0 + 0.55 + 3.0 + 8.0
    rep = report(launch("dead", serve=10, tests=[
        {"nodeid": "t.py::test_a", "t_start": T0 + 4, "t_end": T0 + 7, "outcome": "passed"},
        {"nodeid": "t.py::test_b", "t_start": T0 + 7.5, "t_end": died_at + 0.3, "outcome": "failed"}],
        outcome="died", t_stopped=died_at, failure="killed by SIGKILL with no error in the log"))
    d = dom(rep)
    bar = d.find("bar", launch="dead")[0]
    assert bar.attrs["data-outcome"] == "died"
    mark = bar.find("death-mark")
    assert len(mark) == 1 and mark[0].attrs["stroke"] == FAILED_COLOUR
    assert mark[0].attrs["x1"] == mark[0].attrs["x2"]
    assert pct(mark[0].attrs["x1"]) == pytest.approx((died_at - (T0 - 1)) / (rep["finished_at"] - (T0 - 1)) * 100,
                                                     abs=1e-3)
    marks = {m.attrs["data-nodeid"]: m.attrs["fill"] for m in bar.find("test-mark")}
    assert marks == {"t.py::test_a": TEST_COLOURS["passed"], "t.py::test_b": TEST_COLOURS["failed"]}
    assert "died" in bar.find("bar-label")[0].text()
    assert d.find(tag="div", cls="summary")[0].attrs["data-deaths"] == "1"
    events = check_trace(trace_events(rep))
    deaths = [e for e in events if e["ph"] == "i" and e["name"].startswith("died")]
    assert len(deaths) == 1 and deaths[0]["ts"] == round((died_at - (T0 - 1)) * 1e6)
    assert deaths[0]["args"]["failure"] == "killed by SIGKILL with no error in the log"


def test_interrupted_run_draws_to_the_end_and_marks_it() -> None:
    rep = report(launch("done"), launch("open", gpus=(1,), at=5, t_stop_requested=None, t_stopped=None,
                                        t_released=None, outcome="interrupted"), interrupted=True)
    rep["finished_at"] = T0 + 60
    d = dom(rep)
    bar = d.find("bar", launch="open")[0]
    assert bar.attrs["data-open"] == "1" and bar.find("open-mark")
    serving = next(r for r in bar.find("phase") if r.attrs["data-phase"] == "serving")
    assert d.find(tag="svg", cls="plot")[0].attrs["width"] == "100%"
    assert pct(serving.attrs["x"]) + pct(serving.attrs["width"]) == pytest.approx(100, abs=1e-3)  # the run's end
    assert "interrupted" in bar.find("bar-label")[0].text()
    assert "serving" in bar.title() and "+ (no end recorded)" in bar.title()
    assert d.find("bar", launch="done")[0].attrs["data-open"] == "0"
    assert "interrupted" in d.find(tag="div", cls="summary")[0].text()
    events = check_trace(trace_events(rep))
    assert any(e["ph"] == "i" and e["s"] == "g" for e in events)
    assert [e["name"] for e in xs(events, "serving") if e["args"]["open"]] == ["serving (no end recorded)"]


@pytest.mark.parametrize("rep", [report(), {}, {"launches": None}, {"launches": "x"}, {"launches": [1, None]}],
                         ids=["empty", "no-keys", "null", "str", "junk"])
def test_empty_run(rep: dict[str, Any]) -> None:
    d = dom(rep)
    assert [e.text() for e in d.find("empty")] == ["no worker was launched"]
    assert not d.find("lane") and not d.find("bar")
    assert d.find(tag="div", cls="summary")[0].attrs["data-launches"] == "0"
    trace = trace_events(rep)
    assert check_trace(trace) == []


def test_launch_without_any_time_is_listed_not_drawn() -> None:
    rep = report(launch("blank", tests=[], **NO_TIMES))
    d = dom(rep)
    assert not d.find("bar") and "no launch has a recorded time" in d.find("empty")[0].text()
    assert [r.attrs["data-launch"] for r in d.find("launch-row")] == ["blank"]
    rep = report(launch("blank", tests=[], **NO_TIMES), launch("ok"))
    assert "1 launches without any recorded time are not drawn" in render_html(rep)


def test_missing_times_fall_back_to_the_next_recorded_one() -> None:
    rep = report(launch("a", t_leased=None, t_ready=None, t_stop_requested=None, t_released=None, tests=[
        {"nodeid": "t.py::no_times", "t_start": None, "t_end": None, "outcome": "passed"},
        {"nodeid": "t.py::no_end", "t_start": T0 + 1, "t_end": None, "outcome": "passed"}]))
    bar = dom(rep).find("bar")[0]
    phases = [r.attrs["data-phase"] for r in bar.find("phase")]
    assert phases == ["lease", "startup"]  # lease ends where the start begins, startup at the stop
    assert bar.attrs["data-open"] == "0"
    assert [m.attrs["data-nodeid"] for m in bar.find("test-mark")] == ["t.py::no_end"]
    assert "t.py::no_times" in bar.title()
    check_trace(trace_events(rep))


def test_clock_skew_is_clipped() -> None:
    skewed = launch("skew", at=5, xdist_worker="gw3", t_ready=T0 + 4.0, t_released=T0 + 4.5,
                    tests=[{"nodeid": "t.py::x", "t_start": T0 + 9, "t_end": T0 + 8, "outcome": "passed"}])
    rep = report(launch("a"), skewed, started=T0 + 10)  # started_at after the launches (another clock)
    d = dom(rep)
    for e in d.root.iter():
        for key in ("width", "x", "x1", "x2"):
            if key in e.attrs:
                value = pct(e.attrs[key]) if e.attrs[key].endswith("%") else float(e.attrs[key])
                assert 0 <= value <= 100 or not e.attrs[key].endswith("%"), e.attrs
                assert value >= 0, e.attrs
    xs_ = [pct(r.attrs["x"]) for r in d.find("bar", launch="skew")[0].find("phase")]
    assert xs_ == sorted(xs_)
    events = check_trace(trace_events(rep))
    assert min(e["ts"] for e in events if "ts" in e) == 0


def test_escaping_everywhere() -> None:
    evil = EVIL
    rec = launch(evil, label=evil, config=evil, model=evil, role=evil, group=evil, xdist_worker=evil, node=evil,
                 gpu_names=[evil], argv="sglang " + evil, log_path="/tmp/" + evil, outcome="died", failure=evil,
                 tests=[{"nodeid": "t.py::test[" + evil + "]", "t_start": T0 + 5, "t_end": T0 + 6,
                         "outcome": evil}])
    text = render_html(report(rec))
    assert "<script" not in text.lower() and "<u>" not in text
    assert html.escape(evil) in text
    d = Dom(text)
    assert not d.find(tag="script") and not d.find(tag="u")
    bar = d.find("bar")[0]
    assert bar.attrs["data-launch"] == evil and bar.attrs["data-node"] == evil and bar.attrs["data-role"] == evil
    assert d.find("test-mark")[0].attrs["data-nodeid"] == "t.py::test[" + evil + "]"
    title = bar.title()
    assert "sglang " + evil in title and "/tmp/" + evil in title and f"outcome: died - {evil}" in title
    assert evil in d.find("node-label")[0].text_all()


def test_control_characters_and_surrogates_are_cleaned() -> None:
    text = render_html(report(launch("a", label="bad\x00\x1b[31m\ud800label")))
    assert "\x00" not in text and "\x1b" not in text
    text.encode("utf-8")  # no lone surrogate left


def test_no_remote_fetch_and_no_script() -> None:
    text = render_html(sample_report())
    assert not re.search(r"https?://", text, re.I)
    assert not re.search(r"<script|<img|<iframe|<object|<embed|@import|url\(", text, re.I)
    refs = re.findall(r"""\b(?:src|href|xlink:href|action)\s*=\s*["']?([^"'\s>]*)""", text, re.I)
    assert refs == ["data:,"]  # the favicon, so that a browser does not ask the server for one
    assert "default-src 'none'" in text


def test_hover_text_has_the_details() -> None:
    rec = launch("gw1-7", gpus=(2, 3), xdist_worker="gw1", port=20104, pid=777, label="llama --x 1",
                 argv="python -m sglang.launch_server --tp 2", log_path="/logs/w.log", group="g1", role="prefill",
                 outcome="died", failure="NCCL error", tests=3)
    title = dom(report(rec)).find("bar")[0].title()
    for needle in ["llama --x 1", "[prefill]", "launch gw1-7", "xdist worker gw1", "node node-a", "group g1",
                   "GPUs 2, 3 (sim-gpu-2, sim-gpu-3)", "port 20104", "pid 777", "config qwen3-0.6b",
                   "model Qwen/Qwen3-0.6B", "argv: python -m sglang.launch_server --tp 2", "log: /logs/w.log",
                   "outcome: died - NCCL error", "lease wait 500ms", "startup 3.0s", "serving 20.0s",
                   "teardown 1.0s", "tests (3):", "tests/test_e2e.py::test_gw1-7_0[qwen3-0.6b]  passed 5.3s"]:
        assert needle in title, needle


def test_long_test_ids_and_labels_are_cut_in_labels_full_in_hover() -> None:
    long_id = "tests/test_e2e.py::test_" + "a" * 3000 + "[qwen]"
    long_label = "qwen3-0.6b " + " ".join(f"--flag-{i} {i}" for i in range(200))
    rep = report(launch("a", label=long_label, serve=2, tests=[
        {"nodeid": long_id, "t_start": T0 + 4, "t_end": T0 + 5, "outcome": "failed"}], outcome="died",
        failure="x"), launch("b", at=30, tests=0))
    d = dom(rep)
    label = d.find("bar-label")[0]  # cut to its room by the browser (CSS ellipsis: test_timeline_browser.py)
    assert label.text().startswith("✕ died · qwen3-0.6b --flag-0 0") and len(label.text()) == 400
    assert label.tag == "div" and label.parent is not None and label.parent.tag == "foreignobject"
    assert d.find("test-mark")[0].title().startswith(long_id + "\n")
    assert long_id in d.find("bar")[0].title() and long_label in d.find("bar")[0].title()
    last_test = d.find("failure", tag="tr")[0].find(tag="span")[-1]
    assert last_test.attrs["title"] == long_id and len(last_test.text()) < 80


def test_overlapping_launches_in_one_lane_get_rows() -> None:
    # b waits for GPU 0 while a holds it; c and d run side by side without GPUs
    rep = report(launch("a", serve=10), launch("b", at=2, lease_wait=12), launch("c", gpus=(), at=1),
                 launch("d", gpus=(), at=1.5), launch("e", gpus=(), at=60))
    d = dom(rep)
    rows = {e.attrs["data-gpu"]: e.attrs["data-rows"] for e in d.find("lane")}
    assert rows == {"0": "2", "none": "2"}
    ys = {b.attrs["data-launch"]: float(b.find("phase")[-1].attrs["y"]) for b in d.find("bar")}
    assert ys["a"] != ys["b"] and ys["c"] != ys["d"] and ys["e"] == ys["c"]
    check_trace(trace_events(rep))


def test_bar_labels_never_overlap_the_next_bar() -> None:
    recs = [launch(f"l{i}", at=i * 3.0, serve=1.5, startup=0.2, lease_wait=0.1, teardown=0.1, label="x" * 80)
            for i in range(10)]
    d = dom(report(*recs))
    bars = d.find("bar")
    for a, b in itertools.pairwise(bars):
        (box,) = a.find("bar-label-box")  # the room its label is cut to
        start_next = pct(b.find("phase")[0].attrs["x"])
        assert pct(box.attrs["x"]) + pct(box.attrs["width"]) == pytest.approx(start_next, abs=1e-3)
        assert pct(box.attrs["x"]) == pct(a.find("phase")[0].attrs["x"])
    (last,) = bars[-1].find("bar-label-box")
    assert pct(last.attrs["x"]) + pct(last.attrs["width"]) == pytest.approx(100, abs=1e-3)


def test_labels_without_room_appear_from_the_zoom_level_that_gives_them_room() -> None:
    # 40 launches in 2 hours: at "fit" a 10 s bar followed by the next one 20 s later has ~3 px; zoomed in, more
    recs = [launch(f"l{i}", at=i * 20.0, serve=5, startup=1, lease_wait=0.1, teardown=0.1) for i in range(40)]
    recs.append(launch("late", at=7200.0, serve=5))
    d = dom(report(*recs))
    levels = [int(z) for z in d.find(tag="svg", cls="plot")[0].attrs["data-zoom-levels"].split()]
    assert levels == [1, 2, 4, 8, 16, 32]
    froms = {int(b.attrs["data-from-zoom"]) for b in d.find("bar-label-box")}
    assert 1 in froms and froms - {1} and froms <= set(levels)  # the last bar has room at fit, the others later
    for box in d.find("bar-label-box"):
        zoom = int(box.attrs["data-from-zoom"])
        assert pct(box.attrs["width"]) / 100 * timeline._REF_W * zoom >= timeline._LABEL_MIN_W
        if zoom > 1:
            assert pct(box.attrs["width"]) / 100 * timeline._REF_W * (zoom // 2) < timeline._LABEL_MIN_W
        assert f"from-{zoom}" in box.classes


def test_the_page_fits_the_window_and_zooms_without_script() -> None:
    short = report(launch("a", serve=8, startup=3, lease_wait=0.5, teardown=0.5))  # a 13 s run
    assert short["finished_at"] - short["started_at"] == pytest.approx(14.05)
    long = report(launch("a", serve=7000), launch("b", at=200, gpus=(1,), serve=6800))  # a 2-hour one
    for rep, levels in ((short, [1, 2, 4]), (long, [1, 2, 4, 8, 16, 32])):
        text = render_html(rep)
        d = Dom(text)
        plot = d.find(tag="svg", cls="plot")[0]
        assert plot.attrs["width"] == "100%" and plot.attrs["data-zoom-levels"] == " ".join(map(str, levels))
        buttons = d.find(tag="input")
        assert [b.attrs["id"] for b in buttons] == [f"zoom-{z}" for z in levels]
        assert all(b.attrs["type"] == "radio" and b.attrs["name"] == "zoom" for b in buttons)
        assert "checked" in buttons[0].attrs and not any("checked" in b.attrs for b in buttons[1:])
        labels = {e.attrs["for"]: e.text() for e in d.find(tag="label")}
        assert labels == {f"zoom-{z}": "fit" if z == 1 else f"{z}\N{MULTIPLICATION SIGN}" for z in levels}
        assert d.find(tag="div", cls="zoom")[0].attrs["role"] == "radiogroup"
        for zoom in levels[1:]:  # the CSS that zooms: the plot's width, its ticks
            assert f"body:has(#zoom-{zoom}:checked) .plot-area{{width:{zoom * 100}%}}" in text
            assert f"body:has(#zoom-{zoom}:checked) .tick.z{zoom}{{display:inline}}" in text
        for zoom in levels:  # about 90 px apart or more on a plot of _REF_W px at "fit"
            marks = [t for t in d.find("tick") if f"z{zoom}" in t.classes]
            assert 2 <= len(marks) <= timeline._REF_W * zoom / 90 + 1, (zoom, len(marks))
            at = [pct(t.find(tag="line")[0].attrs["x1"]) for t in marks]
            assert at == sorted(at) and len(set(at)) == len(at)
        assert len(d.find("tick")) < sum(timeline._REF_W * z / 90 + 1 for z in levels)  # shared ticks drawn once
        for e in d.root.iter():  # nothing is placed in pixels along the time axis
            if e.tag in ("rect", "line", "foreignobject") and e.parent is not None and "x" in e.attrs \
                    and e.attrs.get("class") not in ("lane-label", None):
                assert e.attrs["x"].endswith("%"), e.attrs


def test_header_totals() -> None:
    rep = report(launch("a", gpus=(0, 1)), launch("b", gpus=(2,), outcome="died", failure="x", tests=1),
                 launch("c", gpus=(3,), outcome="startup_failed", t_ready=None, tests=0),
                 launch("r", gpus=(), role="router"))
    summary = dom(rep).find(tag="div", cls="summary")[0].attrs
    per_gpu = 0.05 + 3.0 + 20.0 + 1.0  # leased -> released
    assert summary["data-launches"] == "4" and summary["data-failures"] == "1" and summary["data-deaths"] == "1"
    assert float(summary["data-gpu-seconds"]) == pytest.approx(4 * per_gpu, abs=0.1)
    assert summary["data-tests"] == "5" and summary["data-lanes"] == "5"
    assert float(summary["data-wall"]) == pytest.approx(rep["finished_at"] - rep["started_at"])


def test_header_counts_the_tests_as_pytest_does() -> None:
    # a group's two members and its router served the same test; it is one test served
    g: dict[str, Any] = {"group": "g1", "tests": [{"nodeid": "t.py::test_pd", "t_start": T0 + 5, "t_end": T0 + 6,
                                                    "outcome": "error"}]}
    rep = report(launch("p", role="prefill", **g), launch("d", gpus=(1,), role="decode", **g),
                 launch("r", gpus=(), role="router", **g),
                 launch("w", at=30, tests=[{"nodeid": f"t.py::test_{i}", "t_start": T0 + 35 + i, "t_end": T0 + 35.5 + i,
                                            "outcome": o} for i, o in enumerate(["passed", "failed", "skipped"])]))
    # no pytest counts (an older report): each test served once, in its worst outcome
    summary = dom(rep).find(tag="div", cls="summary")[0]
    counts = {k: summary.attrs[f"data-{k}"] for k in ("tests", "passed", "failed", "errors", "skipped")}
    assert counts == {"tests": "4", "passed": "1", "failed": "1", "errors": "1", "skipped": "1"}
    # pytest's own counts win: a test whose call passed and whose teardown failed is one passed and one error
    rep["outcomes"] = {"passed": 6, "failed": 1, "errors": 2, "skipped": 1, "xfailed": 1, "launches": 99}
    summary = dom(rep).find(tag="div", cls="summary")[0]
    counts = {k: summary.attrs[f"data-{k}"] for k in ("tests", "passed", "failed", "errors", "skipped", "xfailed")}
    assert counts == {"tests": "4", "passed": "6", "failed": "1", "errors": "2", "skipped": "1", "xfailed": "1"}
    assert summary.attrs["data-launches"] == "4"  # a count of the report cannot pass for another figure
    shown = " ".join(f"{s.find(tag='b')[0].text()} {''.join(s.texts).strip()}" for s in summary.find("stat"))
    assert "4 tests served 6 passed 1 failed 2 errors 1 skipped 1 xfailed 56.5s wall" in shown


def test_legend_and_distinct_colours() -> None:
    d = dom(sample_report())
    keys = [e.attrs["data-key"] for e in d.find("legend-item")]
    assert keys[:4] == ["lease", "startup", "serving", "teardown"] and "failed" in keys and "test-failed" in keys
    colours = [*PHASE_COLOURS.values(), FAILED_COLOUR]
    assert len(set(colours)) == len(colours)
    assert TEST_COLOURS["passed"] != TEST_COLOURS["failed"]


def test_sample_report_renders_everything() -> None:
    rep = sample_report()
    d = dom(rep)
    outcomes = {b.attrs["data-outcome"] for b in d.find("bar")}
    assert outcomes == {"ok", "startup_failed", "died", "interrupted", "cancelled"}
    assert len(d.find("lane")) == 9 and len(d.find("node")) == 2
    assert len(d.find("bar")) == 16  # 14 launches, two of them on two GPUs
    assert len(d.find("test-mark")) == sum(len(r["tests"]) * max(1, len(r["gpus"])) for r in rep["launches"])
    assert len([t for t in d.find("tick") if "z1" in t.classes]) >= 6


def test_failed_starts_are_drawn_on_their_gpus_with_their_log_and_diagnosis() -> None:
    d = dom(sample_report())
    rows = {r.attrs["data-launch"]: r for r in d.find("failure", tag="tr")}
    # a failed start of its own, on the GPU it leased
    (bar,) = d.find("bar", launch="gw0-3")
    assert (bar.attrs["data-node"], bar.attrs["data-gpu"]) == ("node-a", "0")
    assert bar.parent is not None and bar.parent.attrs["data-gpu"] == "0"
    title = bar.title()
    assert f"outcome: startup_failed - {OOM} (worker qwen3-0.6b" in title and "(exit -9 (SIGKILL))" in title
    assert "log: /tmp/logs/sglang-worker-gw0-3.log" in title and "GPUs 0 (sim-gpu-0)" in title
    cells = [c.text() for c in rows["gw0-3"].find(tag="td")]
    assert cells[:4] == ["gw0-3", "startup_failed", "qwen3-0.6b", "0"]
    assert cells[5].startswith(OOM) and cells[6] == "-9 (SIGKILL)"
    assert cells[7] == "/tmp/logs/sglang-worker-gw0-3.log" and cells[8] == "tests/test_faults.py::test_oom[qwen3-0.6b]"
    # a group whose prefill member failed on GPU 2 and whose decode member, on GPU 3, was cancelled for it
    prefill, decode = d.find("bar", launch="gw2-5")[0], d.find("bar", launch="gw2-6")[0]
    assert [(b.attrs["data-node"], b.attrs["data-gpu"]) for b in (prefill, decode)] == [("node-b", "2"),
                                                                                          ("node-b", "3")]
    assert f"outcome: startup_failed - {KV_OOM}" in prefill.title()
    assert "(exit 1)" in prefill.title() and "log: /tmp/logs/sglang-worker-gw2-5.log" in prefill.title()
    assert "outcome: cancelled - stopped while starting: member prefill 0 of its group failed" in decode.title()
    assert "log: -" in decode.title() and not decode.find("bar-outline")  # not a failure of its own
    assert "cancelled" in decode.find("bar-label")[0].text()
    assert [c.text() for c in rows["gw2-6"].find(tag="td")][1] == "cancelled"  # listed beside its group's failure
    assert [c.text() for c in rows["gw2-5"].find(tag="td")][6:8] == ["1", "/tmp/logs/sglang-worker-gw2-5.log"]
    for member in (prefill, decode):
        assert [m.attrs["data-outcome"] for m in member.find("test-mark")] == ["error"]


def test_a_death_is_drawn_on_its_gpu_with_its_diagnosis() -> None:
    d = dom(sample_report())
    (bar,) = d.find("bar", launch="gw1-2")
    assert (bar.attrs["data-node"], bar.attrs["data-gpu"], bar.attrs["data-outcome"]) == ("node-a", "1", "died")
    assert bar.find("death-mark") and bar.find("bar-outline")[0].attrs["stroke"] == FAILED_COLOUR
    assert f"outcome: died - {KILLED} (worker" in bar.title() and "(exit -9 (SIGKILL))" in bar.title()
    assert [m.attrs["data-outcome"] for m in bar.find("test-mark")] == ["error"]  # as pytest reported the test
    cells = [c.text() for c in d.find("failure", tag="tr", launch="gw1-2")[0].find(tag="td")]
    assert cells[1] == "died" and cells[5].startswith(KILLED) and cells[6] == "-9 (SIGKILL)"
    assert cells[7] == "/tmp/logs/sglang-worker-gw1-2.log"


def test_sample_report_file_is_current() -> None:
    assert json.loads(SAMPLE.read_text()) == json.loads(json.dumps(sample_report())), \
        "regenerate it: python tests/plugin/test_timeline.py"


def test_three_hundred_launches_stay_reasonable() -> None:
    recs = [launch(f"gw{i % 8}-{i}", at=(i // 8) * 26.0, gpus=(i % 8,), xdist_worker=f"gw{i % 8}", tests=4,
                   outcome="died" if i % 37 == 0 else "ok") for i in range(300)]
    rep = report(*recs)
    # How the rendering's time scales with the launches is measured by bench/timeline.py, as a ratio; a test
    # holds no wall-clock limit.
    text = render_html(rep)
    trace = trace_events(rep)
    assert len(text) < 3_000_000, len(text)
    d = Dom(text)
    assert len(d.find("lane")) == 8 and len(d.find("bar")) == 300 and len(d.find("test-mark")) == 1200
    assert {e.attrs["data-rows"] for e in d.find("lane")} == {"1"}
    assert d.find(tag="svg", cls="plot")[0].attrs["width"] == "100%"
    levels = [int(z) for z in d.find(tag="svg", cls="plot")[0].attrs["data-zoom-levels"].split()]
    for zoom in levels:
        assert len([t for t in d.find("tick") if f"z{zoom}" in t.classes]) < timeline._REF_W * zoom / 60
    events = check_trace(trace)
    assert len(xs(events, "launch")) == 300 and len(xs(events, "test")) == 1200


@pytest.mark.parametrize("seed", range(3))
def test_garbage_in_any_field_never_breaks_either_output(seed: int) -> None:
    rng = random.Random(seed)
    junk = [None, True, -1, 0, 1.5, float("nan"), float("inf"), -1e308, 10**30, "x", EVIL, "\ud800", [], {},
            [1, "2", None], {"a": 1}]
    for _ in range(60):
        recs = []
        for i in range(4):
            rec = launch(f"l{i}", at=i * 3.0)
            for key in [*rec, "junk"]:
                if rng.random() < 0.3:
                    rec[key] = rng.choice(junk)
            if isinstance(rec.get("tests"), list) and rec["tests"] and rng.random() < 0.3:
                rec["tests"][0] = {k: rng.choice(junk) for k in ("nodeid", "t_start", "t_end", "outcome")}
            recs.append(rec)
        rep: dict[str, Any] = report(*recs)
        for key in ("started_at", "finished_at", "interrupted", "models", "exitstatus", "engine", "launches",
                    "outcomes"):
            if rng.random() < 0.15:
                rep[key] = rng.choice(junk)
        text = render_html(rep)
        text.encode("utf-8")
        assert "<script" not in text and "<u>" not in text
        Dom(text)
        check_trace(trace_events(rep))


# -- trace ----------------------------------------------------------------------------------------------------

def test_trace_structure_of_the_sample() -> None:
    rep = sample_report()
    events = check_trace(trace_events(rep))
    procs = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(procs) == {"node node-a", "node node-b"}
    threads = sorted((e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name")
    assert (procs["node node-a"], "GPU 0 (sim-gpu-0)") in threads
    assert (procs["node node-a"], "GPU 0 (sim-gpu-0) #2") in threads  # the queued lease
    assert (procs["node node-b"], "no GPU") in threads
    launches = xs(events, "launch")
    assert len(launches) == 16
    args = next(e["args"] for e in launches if e["args"]["launch"] == "gw1-2")
    assert args["outcome"] == "died" and args["gpus"] == [1] and args["port"] == 20160
    assert args["xdist_worker"] == "gw1" and args["log_path"].endswith("gw1-2.log") and "lease wait" in args["phases"]
    assert args["tests"] == ["tests/test_router.py::test_retry_on_dead_worker[qwen3-0.6b]"]
    assert args["diagnosis"] == KILLED and args["exit_code"] == -9
    failed = [e for e in events if e["name"] == "startup (failed)"]
    assert sorted(e["args"]["launch"] for e in failed) == ["gw0-3", "gw2-5"]
    assert len(xs(events, "test")) == sum(len(r["tests"]) * max(1, len(r["gpus"])) for r in rep["launches"])
    instants = sorted(e["name"].split(":")[0] for e in events if e["ph"] == "i")
    assert instants == ["died", "no end recorded", "no end recorded", "run interrupted", "startup_failed",
                        "startup_failed"]


def test_trace_tests_nest_in_a_phase_even_when_they_start_before_the_launch() -> None:
    # the test that caused the launch started before the lease was asked for, and ran into serving
    rep = report(launch("a", tests=[{"nodeid": "t.py::first", "t_start": T0 - 0.5, "t_end": T0 + 6,
                                     "outcome": "passed"},
                                    {"nodeid": "t.py::second", "t_start": T0 + 5.9, "t_end": T0 + 7,
                                     "outcome": "passed"}]))
    events = check_trace(trace_events(rep))
    tests = {e["name"]: e for e in xs(events, "test")}
    assert tests["t.py::first"]["args"]["seconds"] == pytest.approx(6.5)
    assert tests["t.py::second"]["ts"] >= tests["t.py::first"]["ts"] + tests["t.py::first"]["dur"]


def test_trace_times_are_microseconds_from_the_run_start() -> None:
    rep = report(launch("a"), started=T0 - 2)
    events = check_trace(trace_events(rep))
    lease = xs(events, "lease")[0]
    assert lease["ts"] == 2_000_000 and lease["dur"] == 500_000
    serving = xs(events, "serving")[0]
    assert serving["dur"] == 20_000_000


# -- writes ---------------------------------------------------------------------------------------------------

def test_write_html_and_trace_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = sample_report()
    out = tmp_path / "sub" / "timeline.html"
    old_umask = os.umask(0o077)
    try:
        timeline.write_html(out, rep)
        timeline.write_trace(str(tmp_path / "trace.json"), rep)
    finally:
        os.umask(old_umask)
    assert out.read_text(encoding="utf-8") == render_html(rep)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "trace.json").stat().st_mode) == 0o644
    check_trace(json.loads((tmp_path / "trace.json").read_text()))

    def boom(src: str, dst: str, **dir_fds: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        timeline.write_html(out, report())
    assert out.read_text(encoding="utf-8") == render_html(rep)  # the previous file is intact
    assert sorted(p.name for p in out.parent.iterdir()) == ["timeline.html"]  # no temp file left


def test_formatting_helpers() -> None:
    assert [timeline.fmt_duration(s) for s in (-1, 0.34, 12.34, 185, 3725)] == ["0ms", "340ms", "12.3s", "3m05s",
                                                                                "1h02m"]
    assert [timeline.fmt_tick(v, 30) for v in (0, 30, 90, 3600, 3690)] == ["0s", "30s", "1m30s", "1h00m",
                                                                           "1h01m30s"]
    assert timeline.fmt_tick(0.25, 0.05) == "0.25s" and timeline.fmt_tick(1.5, 0.5) == "1.5s"
    assert timeline.truncate("abc", 100) == "abc" and timeline.truncate("abcdef" * 10, 40).endswith("…")
    assert timeline.truncate("abcdef", 3) == ""


if __name__ == "__main__":
    SAMPLE.parent.mkdir(parents=True, exist_ok=True)
    SAMPLE.write_text(json.dumps(sample_report(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {SAMPLE}", file=sys.stderr)
