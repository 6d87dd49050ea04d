"""``python -m pytest_sglworker.sim <sglang argv>``: the simulated engine as a program."""

import sys

from .main import main

sys.exit(main())
