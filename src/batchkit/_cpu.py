"""What the CPU can do and how much of it this process may use, as Linux tells it: the choices
that depend on it (the dtype a model runs in, the attention kernel a dtype goes to, how many
threads torch runs and how they wait) read it here.

Why threads follow the neighbours: torch's CPU build runs its intra-op threads as an OpenMP team,
and GNU OpenMP keeps a thread that finished its share spinning (about 300,000 iterations) before
it sleeps. A decode step is hundreds of small parallel regions, so the team spins through most of
them. Alone on its cores that is the fastest way to run; beside one busy process on a 2-core
machine the spinning threads take the time the working thread needs (and a region waits for a
member the kernel put off), and decode ran at 0.3x. A team that sleeps at once
(``OMP_WAIT_POLICY=PASSIVE``) held 0.8x of its own speed there, but lost 15-25% alone (a wake-up
per region); a team of one thread, with no one to wait for, held its whole speed beside one busy
process. So while other processes use the CPUs, :class:`ThreadGovernor` narrows the team to the
CPUs they leave free, and widens it again when they go (docs/benchmarks.md, "Beside a busy
process"). Where the team is fixed (a CPU quota, a count the user chose), it sleeps when idle
instead; that policy is read once, when torch loads the runtime, so it must be in the environment
before ``import torch``.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CpuThreads",
    "ThreadGovernor",
    "adapt_cpu_threads",
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
        threads: torch's intra-op threads (the most, where ``adaptive``).
        cpus: the CPUs this process may run on (its affinity mask).
        quota: the cgroup's CPU quota in CPUs, or None where there is none.
        threads_from: where ``threads`` came from: ``"cpus"``, ``"quota"``, ``"OMP_NUM_THREADS"``
            or ``"argument"``.
        adaptive: whether the thread count follows the CPUs other processes leave free
            (:class:`ThreadGovernor`): where it came from the CPUs allowed and there are several.
        wait_policy: how the OpenMP team waits between parallel regions: ``"spinning"`` (the
            runtime's default), ``"passive"`` (sleeps at once), or ``"set by <VARIABLE>=<value>"``
            (the environment chose).
        wait_policy_set: whether this call put ``OMP_WAIT_POLICY=PASSIVE`` into the environment.
    """

    threads: int
    cpus: int
    quota: float | None
    threads_from: str
    adaptive: bool
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
        cpus = f"{self.cpus} CPU{'s' if self.cpus != 1 else ''} allowed"
        line = f"CPU threads: {self.threads} ({cpus}, {quota}{source})"
        if self.adaptive:
            line += ", fewer while other processes use the CPUs"
        if self.wait_policy == "passive":
            set_by = ", set by batchkit" if self.wait_policy_set else ""
            return f"{line}; OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE{set_by})"
        if self.wait_policy == "spinning":
            return f"{line}; OpenMP threads spin when idle (the runtime's default)"
        return f"{line}; OpenMP wait policy {self.wait_policy.removeprefix('set by ')} (from the environment)"


def plan_cpu_threads(
    cpus: int,
    quota: float | None,
    environ: Mapping[str, str],
    torch_loaded: bool,
    threads: int | None = None,
    measurable: bool = True,
) -> CpuThreads:
    """What :func:`configure_cpu_threads` chooses, from what it reads (no side effects).

    Threads: ``threads`` where given; else ``OMP_NUM_THREADS`` where it is a positive int; else
    the CPUs allowed, capped by the quota rounded down (at least 1): a team wider than its quota
    is throttled mid-step, and every thread of a parallel region then waits for the slowest.
    Only a count taken from the CPUs allowed (more than one, no quota) adapts to the neighbours,
    and only where their CPU use can be read (``measurable``: Linux's ``/proc/stat``).
    Wait policy: left to ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` where one is
    set; the runtime's spinning default for an adaptive team (the fastest alone; beside busy
    processes the team narrows instead) or where torch is already loaded; else passive.
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
    adaptive = threads_from == "cpus" and quota is None and chosen > 1 and measurable
    user_wait = [name for name in _WAIT_VARIABLES if environ.get(name, "").strip()]
    if user_wait:
        wait, wait_set = f"set by {user_wait[0]}={environ[user_wait[0]].strip()}", False
    elif adaptive or torch_loaded:
        wait, wait_set = "spinning", False
    else:
        wait, wait_set = "passive", True
    return CpuThreads(chosen, cpus, quota, threads_from, adaptive, wait, wait_set)


_governor: ThreadGovernor | None = None


def configure_cpu_threads(threads: int | None = None, environ: MutableMapping[str, str] | None = None) -> CpuThreads:
    """Size torch's CPU threads to the CPUs this process may use, and keep them out of other
    processes' way.

    Call it before ``import torch`` (the OpenMP runtime reads its environment once, when torch
    loads it); ``batchkit serve``, ``batchkit run`` and ``batchkit demo`` call it first thing.
    It writes the thread count into ``environ`` (default ``os.environ``) as ``OMP_NUM_THREADS``
    (or, where torch is already loaded, calls ``torch.set_num_threads``), and where the count is
    fixed (a quota, ``threads``, ``OMP_NUM_THREADS``) ``OMP_WAIT_POLICY=PASSIVE`` unless a wait
    variable is already set (see :func:`plan_cpu_threads`). Where the count comes from the CPUs
    allowed, it starts the process's :class:`ThreadGovernor`: from then on
    :func:`adapt_cpu_threads`, which batchkit's models call at each step, narrows the team while
    other processes use the CPUs. Settings the environment already holds are kept. Imports
    nothing heavy.

    Args:
        threads: torch's intra-op threads (default: the CPUs allowed, capped by a cgroup quota).
        environ: the environment to write (default ``os.environ``, this process's own).

    Returns:
        What was chosen and why; ``describe()`` gives it as one line.

    Raises:
        ValueError: ``threads`` is not an int >= 1.
    """
    global _governor
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 (or None: the CPUs this process may use), got {threads!r}")
    own = environ is None
    env = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules
    plan = plan_cpu_threads(allowed_cpus(), cpu_quota(), env, torch_loaded, threads, Path("/proc/stat").is_file())
    if plan.wait_policy_set:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if plan.threads_from != "OMP_NUM_THREADS":
        env["OMP_NUM_THREADS"] = str(plan.threads)
    if torch_loaded:
        sys.modules["torch"].set_num_threads(plan.threads)
    if own:  # another environment (a child's, a test's) says nothing about this process
        _governor = ThreadGovernor(plan.threads) if plan.adaptive else None
    return plan


def adapt_cpu_threads() -> int | None:
    """Let the process's :class:`ThreadGovernor` (started by :func:`configure_cpu_threads`) fit
    torch's intra-op threads in the calling thread to the CPUs other processes leave free; return
    the thread count in force, or None where no governor runs. Call it in the thread that steps
    the model, before each step (batchkit's ``LlamaModel`` and ``HFStepModel`` do): it measures
    at most four times a second and costs a clock read otherwise."""
    governor = _governor
    return governor.tick() if governor is not None else None


def _cpu_seconds() -> tuple[float, float]:
    """(busy seconds of the CPUs this process may use since boot, this process's own CPU seconds
    since it started): cumulative, read on Linux only; the busy seconds include time the
    hypervisor gave to others (steal)."""
    allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    busy = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in allowed:
                # user nice system idle iowait irq softirq steal ...
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in rest.split()[:8])
                busy += user + nice + system + irq + softirq + steal
    times = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), times.user + times.system


class ThreadGovernor:
    """Fits a team of at most ``max_threads`` torch threads to the CPUs other processes leave free.

    Each :meth:`tick` (in the thread that steps the model) reads, at most once per ``interval_s``,
    how busy the CPUs this process may use were since the last reading, less this process's own
    CPU time: what the neighbours used, in CPUs. The team it proposes is the CPUs allowed less
    that share, rounded to the nearest (at least 1, at most ``max_threads``); a proposal takes
    effect when two readings in a row agree, so that one burst does not resize the team.

    Args:
        max_threads: the widest team (the CPUs allowed).
        interval_s: seconds between readings.
        clock: monotonic seconds (default ``time.monotonic``; injectable for tests).
        read: returns (busy CPU seconds of the allowed CPUs, this process's CPU seconds); default:
            ``/proc/stat`` and ``os.times()``.
        set_threads: applies a thread count in the calling thread (default ``torch.set_num_threads``).
        cpus: the CPUs allowed (default :func:`allowed_cpus`).
    """

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.25,
        *,
        clock: Callable[[], float] | None = None,
        read: Callable[[], tuple[float, float]] | None = None,
        set_threads: Callable[[int], None] | None = None,
        cpus: int | None = None,
    ) -> None:
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.cpus = allowed_cpus() if cpus is None else cpus
        self.threads = max_threads
        self.others = 0.0  # the neighbours' CPUs at the last reading
        self._clock = time.monotonic if clock is None else clock
        self._read = _cpu_seconds if read is None else read
        self._set_threads = set_threads
        self._last: tuple[float, float, float] | None = None  # (time, busy, own)
        self._proposed = max_threads
        self._applied_in: int | None = None  # the thread whose team was last sized

    def threads_for(self, others: float) -> int:
        """The team for neighbours that use ``others`` CPUs."""
        return max(1, min(self.max_threads, math.floor(self.cpus - others + 0.5)))

    def tick(self) -> int:
        """Measure where a reading is due, resize the calling thread's team where it changed (or
        where this thread has not been sized yet); return the team's size."""
        now = self._clock()
        if self._last is None or now - self._last[0] >= self.interval_s:
            busy, own = self._read()
            if self._last is not None:
                elapsed = now - self._last[0]
                self.others = max(0.0, (busy - self._last[1]) - (own - self._last[2])) / elapsed
                proposed = self.threads_for(self.others)
                if proposed == self._proposed and proposed != self.threads:
                    self.threads = proposed
                    self._applied_in = None
                self._proposed = proposed
            self._last = (now, busy, own)
        if self._applied_in != threading.get_ident():
            self._apply(self.threads)
            self._applied_in = threading.get_ident()
        return self.threads

    def _apply(self, threads: int) -> None:
        if self._set_threads is not None:
            self._set_threads(threads)
        else:
            sys.modules["torch"].set_num_threads(threads)
