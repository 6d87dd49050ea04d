"""A stand-in engine that leaves a process behind the way a daemonizing helper does: it double-forks, the middle
process calls ``setsid`` and exits, so the last one is neither a descendant of the worker (it is re-parented) nor in
the worker's session. It still carries the worker's owner tag in its environment, the one way teardown can find it.
Then the engine becomes the simulated engine (``exec``), with the sglang argv it was given.

Environment: ``DOUBLE_FORK_PID_FILE``: where the escaped process writes its pid.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            path = os.environ["DOUBLE_FORK_PID_FILE"]
            with open(path + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(300)
        os._exit(0)
    os.waitpid(middle, 0)
    os.execv(sys.executable, [sys.executable, "-m", "pytest_sglworker.sim", *sys.argv[1:]])


if __name__ == "__main__":
    main()
