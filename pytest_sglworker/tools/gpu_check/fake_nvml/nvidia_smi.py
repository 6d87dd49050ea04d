"""A fake ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` over the dry run's fake GPU state.

Only the query the check makes (``index,uuid,name,memory.total,memory.free,pci.bus_id``) is supported.
"""

from __future__ import annotations

import sys

import pynvml  # the fake one: this file's directory is first on sys.path when run as a script

FIELDS = {
    "index": lambda h: str(pynvml.nvmlDeviceGetIndex(h)),
    "uuid": lambda h: pynvml.nvmlDeviceGetUUID(h),
    "name": lambda h: pynvml.nvmlDeviceGetName(h),
    "memory.total": lambda h: str(pynvml.nvmlDeviceGetMemoryInfo(h).total // pynvml.MIB),
    "memory.free": lambda h: str(pynvml.nvmlDeviceGetMemoryInfo(h).free // pynvml.MIB),
    "pci.bus_id": lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId,
}


def main(argv: list[str]) -> int:
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is None or "--format=csv,noheader,nounits" not in argv:
        print("fake nvidia-smi: only --query-gpu=... --format=csv,noheader,nounits is supported", file=sys.stderr)
        return 2
    fields = query.split(",")
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        print(f"fake nvidia-smi: unknown field(s) {unknown}", file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            print(", ".join(FIELDS[f](handle) for f in fields))
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
