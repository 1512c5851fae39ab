"""What the CPU can do, as Linux lists it: the choices that depend on it (the dtype a model runs
in, the attention kernel a dtype goes to) read it here."""

from __future__ import annotations

import functools

__all__ = ["cpu_flags", "has_amx"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it is not there); read once."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_amx(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (``amx_bf16``); ``flags`` default to this CPU's."""
    return "amx_bf16" in (cpu_flags() if flags is None else flags)
