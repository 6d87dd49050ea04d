"""A stand-in engine that logs the way a plain ``print`` does and never flushes: it prints its last words and is
then killed (as by the kernel's OOM killer), so nothing the interpreter buffered would ever reach the log. Only
an unbuffered stdout (``PYTHONUNBUFFERED=1`` in the worker's environment) gets the line into the log in time.

Started as ``python unflushed.py <sglang argv>`` (without ``-u``); the argv is ignored: it never binds a port.
"""

from __future__ import annotations

import os
import signal

LAST_WORDS = "unflushed engine: loading the weights failed, dying now"


def main() -> None:
    print("unflushed engine: starting")
    print(LAST_WORDS)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
