"""``python -m pytest_sglworker.sim <sglang argv>``: the simulated engine as a program."""

import sys

from .main import main, process_age

sys.exit(main(since_exec=process_age()))
