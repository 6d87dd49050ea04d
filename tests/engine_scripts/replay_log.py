"""A stand-in engine for the failure-text corpus: it writes a log fixture of ``tests/data/logs`` (its ``# `` header
lines left out) to its stdout, as the real engine would have logged it, then ends as that engine ended.

Environment: ``SGLREPLAY_LOG`` (the fixture's path), ``SGLREPLAY_EXIT`` (the exit code; a negative one is a death by
that signal). The sglang argv it is given is ignored: it never binds a port.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    with open(os.environ["SGLREPLAY_LOG"], encoding="utf-8") as fh:
        for line in fh:
            if not line.startswith("# "):
                sys.stdout.write(line)
    sys.stdout.flush()
    code = int(os.environ.get("SGLREPLAY_EXIT", "1"))
    if code < 0:
        os.kill(os.getpid(), -code)
        signal.pause()
    return code


if __name__ == "__main__":
    sys.exit(main())
