"""The ``--sgl-gpus`` value: which GPUs a run may use, parsed (:func:`parse_gpus_option`), and which GPUs a
``CUDA_VISIBLE_DEVICES`` value makes visible (:func:`resolve_visible_devices`).

Plain Python; imports nothing of the plugin. Indices are NVML indices (see the index conventions in
:mod:`pytest_sglworker.resources.gpus`). A declared selection (``sim:N``, ``sim:NxGiB``) names the lease
namespace of its simulated inventory (:attr:`GpuSelection.namespace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_SIM_GIB",
    "GpuSelection",
    "gib_text",
    "parse_gpus_option",
    "resolve_visible_devices",
    "sim_namespace",
]

DEFAULT_SIM_GIB = 80
_ACCEPTED_FORMS = (
    "accepted forms: '' or 'auto' (every GPU NVML reports), '0,2' (NVML indices, as nvidia-smi numbers "
    "them), 'GPU-<uuid>,...' (UUIDs or unique UUID prefixes), 'sim:N' or 'sim:NxGiB' (N simulated GPUs "
    f"of GiB each, default {DEFAULT_SIM_GIB}, e.g. sim:4x80)"
)


@dataclass(frozen=True)
class GpuSelection:
    """A parsed ``--sgl-gpus`` value (see :func:`parse_gpus_option`)."""

    kind: Literal["auto", "indices", "uuids", "sim"]
    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    sim_count: int = 0
    sim_total_mib: int = 0
    raw: str = ""

    @property
    def is_simulated(self) -> bool:
        return self.kind == "sim"

    @property
    def namespace(self) -> str:
        """Lock-file namespace: ``nvml`` for real GPUs, ``sim-<N>x<GiB>`` for a declared inventory."""
        if self.kind != "sim":
            return "nvml"
        return sim_namespace(self.sim_count, self.sim_total_mib)

    def __str__(self) -> str:
        if self.kind == "auto":
            return "auto"
        if self.kind == "indices":
            return ",".join(str(i) for i in self.indices)
        if self.kind == "uuids":
            return ",".join(self.uuids)
        return f"sim:{self.sim_count}x{gib_text(self.sim_total_mib)}"


def gib_text(total_mib: int) -> str:
    return f"{total_mib / 1024:g}"


def sim_namespace(count: int, total_mib: int) -> str:
    return f"sim-{count}x{gib_text(total_mib)}"


def parse_gpus_option(value: str) -> GpuSelection:
    """Parse ``--sgl-gpus``: ``''``/``auto``, ``0,2``, ``GPU-<uuid>,...``, ``sim:N``, ``sim:NxGiB``.

    Indices are NVML indices. Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    raw = value
    text = value.strip()

    def bad(why: str) -> ValueError:
        return ValueError(f"invalid GPU selection {raw!r}: {why}; {_ACCEPTED_FORMS}")

    if text == "" or text.lower() == "auto":
        return GpuSelection(kind="auto", raw=raw)
    if text.lower().startswith("sim:"):
        spec = text[4:].strip().lower()
        count_text, sep, gib_text = spec.partition("x")
        try:
            count = int(count_text)
        except ValueError:
            raise bad(f"{count_text!r} is not a whole number of simulated GPUs") from None
        if count < 1:
            raise bad("a simulated inventory needs at least one GPU")
        gib = float(DEFAULT_SIM_GIB)
        if sep:
            try:
                gib = float(gib_text)
            except ValueError:
                raise bad(f"{gib_text!r} is not a GPU size in GiB") from None
            if not 0 < gib < float("inf"):
                raise bad(f"the GPU size must be a positive number of GiB, not {gib_text!r}")
        total_mib = round(gib * 1024)
        if total_mib < 1:
            raise bad(f"{gib_text!r} GiB is less than 1 MiB")
        return GpuSelection(kind="sim", sim_count=count, sim_total_mib=total_mib, raw=raw)
    tokens = [t.strip() for t in text.split(",")]
    if any(t == "" for t in tokens):
        raise bad("empty entry in the list")
    if all(t.isdigit() for t in tokens):
        indices = tuple(int(t) for t in tokens)
        if len(set(indices)) != len(indices):
            raise bad("an index is listed twice")
        return GpuSelection(kind="indices", indices=indices, raw=raw)
    if all(t.upper().startswith("GPU-") and len(t) > 4 for t in tokens):
        uuids = tuple("GPU-" + t[4:] for t in tokens)
        if len({u.lower() for u in uuids}) != len(uuids):
            raise bad("a UUID is listed twice")
        return GpuSelection(kind="uuids", uuids=uuids, raw=raw)
    wrong = [t for t in tokens if not (t.isdigit() or (t.upper().startswith("GPU-") and len(t) > 4))]
    if wrong:
        raise bad(f"{wrong[0]!r} is neither a GPU index nor a GPU UUID")
    raise bad("indices and UUIDs cannot be mixed")


def resolve_visible_devices(value: str | None, uuids: Sequence[str]) -> list[int]:
    """Which NVML indices a ``CUDA_VISIBLE_DEVICES`` value makes visible, given the UUID of each index.

    ``None`` (unset): all. Entries are NVML indices, ``GPU-`` UUIDs or unique UUID prefixes; like the
    CUDA driver, the list ends at the first entry that names no device (``-1``, out of range, unknown,
    ambiguous, ``MIG-...``, repeated). The result is sorted.
    """
    if value is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        index: int | None = None
        if token.isdigit():
            number = int(token)
            index = number if number < len(uuids) else None
        elif token.upper().startswith("GPU-") and len(token) > 4:
            matches = [i for i, u in enumerate(uuids) if u.lower().startswith(token.lower())]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in chosen:
            break
        chosen.append(index)
    return sorted(chosen)
