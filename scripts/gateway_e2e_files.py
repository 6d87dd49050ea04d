"""Write upstream's gateway e2e test files that ``tests/compat_gateway/test_gateway_upstream.py`` runs, each at its
pinned commit, from a sglang clone of yours.

    python scripts/gateway_e2e_files.py /path/to/sglang-clone [DEST]

The files are upstream's (https://github.com/sgl-project/sglang, ``sgl-model-gateway/e2e_test/``, Apache-2.0) and
are not part of this repository: ``tests/data/gateway_e2e/MANIFEST.json`` names each one's path, commit and sha256.
This writes each with ``git show COMMIT:PATH`` into DEST at its upstream path (default: the user's cache directory,
``<cache>/pytest-sglworker/sglang-tests``, where the tests look without ``SGLWORKER_SGLANG_TESTS``), checks its
sha256, and says what it could not write: ``scripts/sglang_test_files.py`` with this manifest.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_test_files import REPO, main

MANIFEST = REPO / "tests" / "data" / "gateway_e2e" / "MANIFEST.json"

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], "--manifest", str(MANIFEST)]))
