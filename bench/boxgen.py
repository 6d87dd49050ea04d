"""A seeded generator of GPU-box suites (issue 43), in the plan format of bench/suites/gpu_box (bench/bound.py's).

    .venv/bin/python bench/boxgen.py 7            # print suite 7's plan (JSON) and its lower bound

A suite is 8 to 24 worker configurations on an 8-GPU box: most of one GPU (``tp1``), some of two (``tp2``), and
with one chance in three one prefill/decode pair (``pd``, 1 + 1 GPUs); each starts in 1 to 8 seconds and has 1 to
8 tests of 0.1 to 1.5 seconds. The same seed gives the same suite on every machine (``random.Random(seed)``,
nothing else read). The times are the simulated engine's (``SGLSIM_STARTUP_SECONDS``) and the tests' sleeps, and each
configuration carries the startup a team would declare for it (``ModelSpec.startup_seconds``: off by up to 30 %);
``scale`` multiplies all of them alike, so a bound computed on the scaled plan is in the units the run takes.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

#: the ranges the issue names
CONFIGURATIONS = (8, 24)
STARTUP = (1.0, 8.0)
TESTS = (1, 8)
TEST_SECONDS = (0.1, 1.5)
#: the share of two-GPU configurations, and the chance that a suite holds one prefill/decode pair
TP2_SHARE = 0.3
PD_CHANCE = 1 / 3


#: a declared startup is the real one times a factor in this range (a team's estimate of its launches)
DECLARED = (0.7, 1.3)


def generate(seed: int, scale: float = 1.0) -> list[dict[str, Any]]:
    """Suite ``seed``: its configurations (``name``, ``kind``, ``startup``, ``tests``, and ``declared``: the
    startup its spec declares, within :data:`DECLARED` of the real one), times multiplied by ``scale`` (rounded to
    the millisecond). The declared startups come from a generator of their own: the suites are those of before."""
    if scale <= 0:
        raise ValueError(f"scale must be above 0, not {scale!r}")
    rng = random.Random(f"pytest-sglworker box suite {seed}")
    count = rng.randint(*CONFIGURATIONS)
    kinds = ["tp2" if rng.random() < TP2_SHARE else "tp1" for _ in range(count)]
    if rng.random() < PD_CHANCE:
        kinds[rng.randrange(count)] = "pd"
    configs = []
    for i, kind in enumerate(kinds):
        startup = rng.uniform(*STARTUP)
        tests = [rng.uniform(*TEST_SECONDS) for _ in range(rng.randint(*TESTS))]
        configs.append({"name": f"g{seed}c{i:02d}", "kind": kind, "startup": round(startup * scale, 3),
                        "tests": [round(t * scale, 3) for t in tests]})
    guess = random.Random(f"pytest-sglworker box suite {seed}: declared startups")
    for config in configs:
        config["declared"] = round(config["startup"] * guess.uniform(*DECLARED), 3)
    return configs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: bench/boxgen.py SEED [SCALE]", file=sys.stderr)
        return 2
    from bound import bound  # bench/bound.py, a sibling

    configs = generate(int(args[0]), float(args[1]) if len(args) == 2 else 1.0)
    print(json.dumps({"configurations": configs, "bound": bound(configs)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
