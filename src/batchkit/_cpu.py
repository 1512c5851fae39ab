"""What the CPU can do and how much of it this process may use, as Linux tells it: the choices
that depend on it (the dtype a model runs in, the attention kernel a dtype goes to, how many
threads torch runs and how they wait) read it here.

Why the wait policy matters: torch's CPU build runs its intra-op threads as an OpenMP team, and
GNU OpenMP keeps a thread that finished its share spinning for about 300,000 iterations before it
sleeps. A decode step is hundreds of small parallel regions, so the team spins through most of
them; alone on its cores that costs nothing, but beside one busy process on a 2-core machine the
spinning threads take the time the working thread needs, and decode ran 2.5x slower (15x beside
two). A team that sleeps at once (``OMP_WAIT_POLICY=PASSIVE``) kept about 80% of its speed
there (docs/benchmarks.md, "Beside a busy process"). The runtime reads the policy once, when torch
loads it, so it must be in the environment before ``import torch``.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CpuThreads",
    "allowed_cpus",
    "configure_cpu_threads",
    "cpu_flags",
    "cpu_quota",
    "has_amx",
    "plan_cpu_threads",
]

# The variables by which a user (or their platform) already chose how OpenMP threads wait:
# GNU OpenMP's spin count, Intel/LLVM OpenMP's block time, and the standard policy.
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


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


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_quota(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU time this process's cgroup may use, in CPUs (``1.5``: 150 ms per 100 ms), or None.

    Reads cgroup v2's ``cpu.max`` of the process's cgroup and of each of its ancestors (the
    smallest limit wins), or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None where no
    limit is set or none can be read (not Linux, no cgroup file system).
    """
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.strip("/")
        if controllers == "":  # v2: one unified hierarchy
            folder = cgroup_root / relative
            while True:
                limits.extend(_v2_limit(folder / "cpu.max"))
                if folder == cgroup_root or cgroup_root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            mount = cgroup_root / controllers
            if not mount.is_dir():
                mount = cgroup_root / "cpu"
            # Inside a container's cgroup namespace the path may not exist under the mount: its
            # root is then the container's own cgroup.
            for folder in (mount / relative, mount):
                found = _v1_limit(folder)
                if found is not None:
                    limits.extend(found)
                    break
    return min(limits) if limits else None


def _v2_limit(cpu_max: Path) -> list[float]:
    try:
        quota, _, period = cpu_max.read_text(encoding="ascii").strip().partition(" ")
    except OSError:
        return []
    if quota == "max" or not period:
        return []
    return [int(quota) / int(period)]


def _v1_limit(folder: Path) -> list[float] | None:
    """[limit] or [] (unlimited) where the files are, None where they are not."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="ascii"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None
    return [quota / period] if quota > 0 and period > 0 else []


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """How torch's CPU threads run in this process, and why: what :func:`configure_cpu_threads`
    chose (or found already chosen).

    Attributes:
        threads: torch's intra-op threads.
        cpus: the CPUs this process may run on (its affinity mask).
        quota: the cgroup's CPU quota in CPUs, or None where there is none.
        threads_from: where ``threads`` came from: ``"cpus"``, ``"quota"``, ``"OMP_NUM_THREADS"``
            or ``"argument"``.
        wait_policy: how the OpenMP team waits between parallel regions: ``"passive"`` (sleeps at
            once), ``"set by <VARIABLE>=<value>"`` (the environment chose), or ``"spinning"`` (torch
            was loaded before it could be set: the runtime's default stands).
        wait_policy_set: whether this call put ``OMP_WAIT_POLICY=PASSIVE`` into the environment.
    """

    threads: int
    cpus: int
    quota: float | None
    threads_from: str
    wait_policy: str
    wait_policy_set: bool

    def describe(self) -> str:
        """One line for a start-up log: ``CPU threads: 2 (2 CPUs allowed, no CPU quota), ...``."""
        quota = "no CPU quota" if self.quota is None else f"CPU quota {self.quota:g}"
        source = {
            "cpus": "",
            "quota": ", from the quota",
            "OMP_NUM_THREADS": ", from OMP_NUM_THREADS",
            "argument": ", as asked",
        }[self.threads_from]
        if self.wait_policy == "passive":
            waits = "OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE"
            waits += ", set by batchkit)" if self.wait_policy_set else ")"
        elif self.wait_policy == "spinning":
            waits = "OpenMP threads spin when idle (torch was loaded before OMP_WAIT_POLICY could be set)"
        else:
            waits = f"OpenMP wait policy {self.wait_policy.removeprefix('set by ')} (from the environment)"
        return f"CPU threads: {self.threads} ({self.cpus} CPUs allowed, {quota}{source}); {waits}"


def plan_cpu_threads(
    cpus: int,
    quota: float | None,
    environ: Mapping[str, str],
    torch_loaded: bool,
    threads: int | None = None,
) -> CpuThreads:
    """What :func:`configure_cpu_threads` chooses, from what it reads (no side effects).

    Threads: ``threads`` where given; else ``OMP_NUM_THREADS`` where it is a positive int; else
    the CPUs allowed, capped by the quota rounded down (at least 1): a team wider than its quota
    is throttled mid-step, and every thread of a parallel region then waits for the slowest.
    Wait policy: left to ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` where one is
    set; else passive where torch is not loaded yet; else the runtime's spinning default.
    """
    from_env = environ.get("OMP_NUM_THREADS", "").strip()
    if threads is not None:
        chosen, threads_from = threads, "argument"
    elif from_env.isdigit() and int(from_env) > 0:
        chosen, threads_from = int(from_env), "OMP_NUM_THREADS"
    elif quota is not None and math.floor(quota) < cpus:
        chosen, threads_from = max(1, math.floor(quota)), "quota"
    else:
        chosen, threads_from = max(1, cpus), "cpus"
    user_wait = [name for name in _WAIT_VARIABLES if environ.get(name, "").strip()]
    if user_wait:
        wait, wait_set = f"set by {user_wait[0]}={environ[user_wait[0]].strip()}", False
    elif torch_loaded:
        wait, wait_set = "spinning", False
    else:
        wait, wait_set = "passive", True
    return CpuThreads(chosen, cpus, quota, threads_from, wait, wait_set)


def configure_cpu_threads(threads: int | None = None, environ: MutableMapping[str, str] | None = None) -> CpuThreads:
    """Size torch's CPU threads to the CPUs this process may use and make them sleep when idle.

    Call it before ``import torch`` (the OpenMP runtime reads its wait policy once, when torch
    loads it); ``batchkit serve``, ``batchkit run --model`` and ``batchkit demo`` call it first
    thing. It puts ``OMP_WAIT_POLICY=PASSIVE`` into ``environ`` (default ``os.environ``) unless a
    wait variable is already set (see :func:`plan_cpu_threads`), and the thread count into
    ``OMP_NUM_THREADS`` (or, where torch is already loaded, ``torch.set_num_threads``). Settings
    the environment already holds are kept. Imports nothing heavy.

    Args:
        threads: torch's intra-op threads (default: the CPUs allowed, capped by a cgroup quota).

    Returns:
        What was chosen and why; ``describe()`` gives it as one line.

    Raises:
        ValueError: ``threads`` is not an int >= 1.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 (or None: the CPUs this process may use), got {threads!r}")
    env = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules
    plan = plan_cpu_threads(allowed_cpus(), cpu_quota(), env, torch_loaded, threads)
    if plan.wait_policy_set:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if plan.threads_from != "OMP_NUM_THREADS":
        env["OMP_NUM_THREADS"] = str(plan.threads)
    if torch_loaded:
        sys.modules["torch"].set_num_threads(plan.threads)
    return plan
