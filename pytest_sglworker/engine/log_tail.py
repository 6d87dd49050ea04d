"""The tail of a worker's log as a failure report quotes it: the log, not the plugin.

A raw tail of an sglang log is often useless: a hang shows forty copies of the plugin's own readiness probe
(``"GET /ready HTTP/1.1" 503``), a startup shows pages of progress bars, a crash can hide behind one 15 KB
``server_args=...`` line, and the first error may sit far above the last lines. :func:`condense` turns the lines
of a log into the lines worth reading, within a bound:

- runs of the plugin's health probes become one line: ``… 38 x GET /ready 503 (health probes)``;
- runs of identical lines (timestamps aside) and of progress-bar lines become the last one with a count;
- a very long line is cut, its length said;
- a long traceback keeps its first frame and its last two, the frames between counted;
- a parser's usage message keeps its first line, its continuation lines counted;
- lines that are never a cause (sglang's ``server_args=...`` dump, the simulated engine's note on its token counts)
  fold into one ``… N setup lines …``;
- lines the failure text already quotes above the tail (its first error, what is not the cause) are marked there
  (``… the first error (5 lines), quoted above …``), not repeated;
- the first error's neighbourhood is kept even when it lies far above the end (with the lines between said
  as skipped), then the end of the log.

Plain Python, stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MAX_LINE_CHARS", "CondensedTail", "condense"]

#: A line longer than this is cut (sglang's ``server_args=...`` line runs to 15 KB).
MAX_LINE_CHARS = 300
#: Lines kept before and after the first error when it lies above the end of the log.
ERROR_CONTEXT = (2, 4)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?: [A-Z_]+\d+)*\] ?")
#: uvicorn's access line for one of the readiness paths the plugin probes
_PROBE = re.compile(r'INFO: +[\d.:\[\]a-f]+ - "(?P<method>GET|HEAD) (?P<path>/ready|/health_generate|/health|/ping) '
                    r'HTTP/[\d.]+" (?P<status>\d{3})')
#: a tqdm progress bar (``Capturing batches (bs=8 ...):  88%|████████  | 32/36 [...]``)
_PROGRESS = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")
#: a traceback's frame header (its code line follows, indented deeper)
_FRAME = re.compile(r'^\s*File ".*", line \d+')
#: frames of one traceback kept at its start and its end (the ones between are counted)
FRAMES_KEPT = (1, 2)
#: an argparse usage message (``usage: sglang serve [-h] ...``), its continuation lines indented below it
_USAGE = re.compile(r"^usage: ")
#: lines that are never a cause: sglang's dump of its arguments, the simulated engine's note on its token counts
_SETUP = re.compile(r"^(?:server_args=|\(sim\) counting tokens without the model's tokenizer)")
#: a rank prefix without a time (``[TP0] ``), as the diagnosis strips it from the lines it quotes
_RANK = re.compile(r"^\[[A-Z_]+\d+(?: [A-Z_]+\d+)*\] ?")


@dataclass(frozen=True)
class CondensedTail:
    """What :func:`condense` kept, and what it said instead of the rest."""

    lines: tuple[str, ...]
    #: notes for the tail's header: ``["38 health probes collapsed", "1 line cut"]``
    notes: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _shown(line: str) -> str:
    """What a terminal shows of a line: a progress bar rewrites itself with carriage returns, the last one stays;
    colours (the router's) are dropped, as a CI page or a junit report would show them as escape codes."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\r" not in line:
        return line.rstrip()
    return next((part for part in reversed(line.split("\r")) if part.strip()), "").rstrip()


def _key(line: str) -> str:
    return _STAMP.sub("", line).rstrip()


class _Quotes:
    """The lines a failure text quotes above its tail (text -> what it is quoted as); a quote cut with ``...``
    stands for every line it begins."""

    def __init__(self, quoted: Mapping[str, str]) -> None:
        self.exact = {text.strip(): label for text, label in quoted.items() if text.strip()}
        self.cut = [(text.strip()[:-3], label) for text, label in quoted.items()
                    if text.strip().endswith("...") and len(text.strip()) > 3]

    def label(self, key: str) -> str | None:
        if not self.exact:
            return None
        text = _RANK.sub("", key).strip()
        found = self.exact.get(text)
        if found is None:
            found = next((label for start, label in self.cut if text.startswith(start)), None)
        return found


def _cut(line: str) -> tuple[str, bool]:
    if len(line) <= MAX_LINE_CHARS:
        return line, False
    return f"{line[:MAX_LINE_CHARS]} … ({len(line):,} characters, cut)", True


@dataclass
class _Run:
    kind: str  # "line", "probe", "progress", "frames", "setup", "quoted"
    first: int  # index in the log's lines
    last: int
    text: str
    probe: str = ""  # a probe's label ("GET /ready 503"); what a quoted run is quoted as


def _frames(lines: Sequence[str], start: int) -> list[tuple[int, int]]:
    """The frames of the traceback whose first frame header is at ``start``: ``(first, last)`` line indexes."""
    frames = []
    i = start
    while i < len(lines) and _FRAME.match(lines[i]):
        indent = len(lines[i]) - len(lines[i].lstrip())
        j = i + 1
        while j < len(lines) and lines[j].strip() and not _FRAME.match(lines[j]) and \
                len(lines[j]) - len(lines[j].lstrip()) > indent:
            j += 1
        frames.append((i, j - 1))
        i = j
    return frames


def _runs(lines: Sequence[str], quotes: _Quotes) -> list[_Run]:
    """The log's lines, with consecutive probes (same path and status), identical lines, progress bars, setup lines,
    lines quoted above (with the same label) and the middle frames of a long traceback folded into one run each."""
    runs: list[_Run] = []
    skip_to = -1
    for i, line in enumerate(lines):
        if i <= skip_to:
            continue
        if _USAGE.match(_key(line)):
            end = i
            while end + 1 < len(lines) and lines[end + 1].startswith((" ", "\t")) and lines[end + 1].strip():
                end += 1
            if end > i:
                runs.append(_Run("line", i, i, line))
                runs.append(_Run("frames", i + 1, end, f"… {end - i} more lines of usage …"))
                skip_to = end
                continue
        if _FRAME.match(line):
            frames = _frames(lines, i)
            first, last = FRAMES_KEPT
            if len(frames) > first + last + 1:
                for a, b in frames[:first]:
                    runs.extend(_Run("line", k, k, lines[k]) for k in range(a, b + 1))
                hidden = frames[first:-last]
                runs.append(_Run("frames", hidden[0][0], hidden[-1][1], f"… {len(hidden)} frames …"))
                for a, b in frames[-last:]:
                    runs.extend(_Run("line", k, k, lines[k]) for k in range(a, b + 1))
                skip_to = frames[-1][1]
                continue
        key = _key(line)
        label = quotes.label(key)
        folded = "quoted" if label is not None else "setup" if _SETUP.match(key) else None
        if folded is not None:
            label = label or folded
            if runs and runs[-1].kind == folded and runs[-1].probe == label:
                runs[-1].last = i
            else:
                runs.append(_Run(folded, i, i, line, label))
            continue
        probe = _PROBE.search(key)
        if probe is not None:
            label = f"{probe.group('method')} {probe.group('path')} {probe.group('status')}"
            if runs and runs[-1].kind == "probe" and runs[-1].probe == label:
                runs[-1].last, runs[-1].text = i, line
                continue
            runs.append(_Run("probe", i, i, line, label))
            continue
        if _PROGRESS.search(key):
            if runs and runs[-1].kind == "progress":
                runs[-1].last, runs[-1].text = i, line
                continue
            runs.append(_Run("progress", i, i, line))
            continue
        if runs and runs[-1].kind == "line" and _key(runs[-1].text) == key:
            runs[-1].last, runs[-1].text = i, line
            continue
        runs.append(_Run("line", i, i, line))
    return runs


def _render(run: _Run, notes: dict[str, int]) -> str:
    count = run.last - run.first + 1
    if run.kind == "frames":
        notes["frames" if run.text.endswith("frames …") else "usage"] += count
        return run.text
    if run.kind == "probe":
        notes["probes"] += count
        return f"… {count} x {run.probe} (health probes)"
    if run.kind == "setup":
        notes["setup"] += count
        return f"… {count} setup line{'s' if count > 1 else ''} (the engine's arguments and notes) …"
    if run.kind == "quoted":
        notes["quoted"] += count
        stamp = run.text[:len(run.text) - len(_STAMP.sub("", run.text))]
        lines = f" ({count} lines)" if count > 1 else ""
        return f"{stamp}… {run.probe}{lines}, quoted above …"
    text, cut = _cut(run.text)
    notes["cut"] += cut
    if count == 1:
        return text
    if run.kind == "progress":
        notes["progress"] += count - 1
        return f"{text}  (… {count} progress lines, the last shown)"
    notes["repeats"] += count - 1
    return f"{text}  (x {count})"


def condense(lines: Sequence[str], limit: int, *, first_error_line: int | None = None,
             line_offset: int = 0, quoted: Mapping[str, str] | None = None) -> CondensedTail:
    """The last lines of a log worth reading, at most ``limit`` of them. ``lines`` are the log's last lines;
    ``line_offset`` is the number of log lines before ``lines[0]`` (so that ``first_error_line``, a 1-based log
    line number counted in newlines, can be found among them). When the first error lies above the last lines,
    its neighbourhood is kept first, then ``… N lines …``, then the end. ``quoted``: the lines the failure text
    quotes above the tail (their text, without the log's time stamp, to what they are quoted as: ``the first
    error``), marked where they stand instead of repeated."""
    if limit <= 0 or not lines:
        return CondensedTail(())
    lines = [_shown(line) for line in lines]
    runs = _runs(lines, _Quotes(quoted or {}))
    chosen: list[_Run | int] = list(runs[-limit:])  # an int: that many log lines skipped
    error = None if first_error_line is None else first_error_line - 1 - line_offset
    if error is not None and 0 <= error < runs[-limit:][0].first:
        at = next(k for k, run in enumerate(runs) if run.first <= error <= run.last)
        before, after = ERROR_CONTEXT
        head = runs[max(0, at - before): at + after + 1]
        room = limit - len(head) - 1
        if room > 0:
            tail = [run for run in runs[-room:] if run.first > head[-1].last]
            skipped = (tail[0].first if tail else len(lines)) - head[-1].last - 1
            chosen = [*head, *([skipped] if skipped > 0 else []), *tail]
    notes = {"probes": 0, "progress": 0, "repeats": 0, "cut": 0, "frames": 0, "usage": 0, "setup": 0, "quoted": 0}
    out = [f"… {item} lines …" if isinstance(item, int) else _render(item, notes) for item in chosen]
    said = []
    if notes["probes"]:
        said.append(f"{notes['probes']} health probe lines collapsed")
    if notes["progress"]:
        said.append(f"{notes['progress']} progress-bar lines collapsed")
    if notes["repeats"]:
        said.append(f"{notes['repeats']} repeated lines collapsed")
    if notes["frames"]:
        said.append(f"{notes['frames']} traceback lines folded")
    if notes["usage"]:
        said.append(f"{notes['usage']} usage lines folded")
    if notes["setup"]:
        said.append(f"{notes['setup']} setup line{'s' if notes['setup'] > 1 else ''} folded")
    if notes["quoted"]:
        said.append(f"{notes['quoted']} line{'s' if notes['quoted'] > 1 else ''} quoted above marked")
    if notes["cut"]:
        said.append(f"{notes['cut']} long line{'s' if notes['cut'] > 1 else ''} cut")
    return CondensedTail(tuple(out), tuple(said))
