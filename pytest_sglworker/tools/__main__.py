"""``python -m pytest_sglworker.tools``: the ``sglworker`` command (for a checkout without the console script)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
