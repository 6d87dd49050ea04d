"""The simulated engine: a program of its own (``python -m pytest_sglworker.sim <sglang argv>``) that speaks
sglang's CLI, HTTP, gRPC and PD on a real port, with switchable faults (see :mod:`.main`).

It imports the engine layer (the flag table, the memory arithmetic) and nothing above it. The rest of the
package starts it as a subprocess and imports only what this package surface names: the environment
variables through which a worker's environment configures it, and the fault-setting check that collection
runs before anything launches.

A new sim fault is one new record in :data:`pytest_sglworker.sim.faults.FAULTS` (with the field it sets in
``Faults`` or ``RequestFaults`` of the same module), plus the code that acts on it where it acts.
"""

from .core import ENV_FAULT, ENV_GPU_FREE, ENV_GPU_MEM
from .faults import FaultError, parse_fault_spec

__all__ = ["ENV_FAULT", "ENV_GPU_FREE", "ENV_GPU_MEM", "FaultError", "parse_fault_spec"]
