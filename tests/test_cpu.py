"""batchkit._cpu: the CPUs a process may use (affinity, cgroup quota) and the thread settings
configure_cpu_threads chooses from them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import batchkit
from batchkit import _cpu
from batchkit._cpu import configure_cpu_threads, cpu_quota, plan_cpu_threads


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---------------------------------------------------------------------- cpu_quota


def test_v2_quota_is_cpu_max_in_cpus(tmp_path: Path) -> None:
    """cgroup v2: ``150000 100000`` in the process's cgroup's cpu.max is 1.5 CPUs."""
    _write(tmp_path / "proc", "0::/pods/web\n")
    _write(tmp_path / "cg" / "pods" / "web" / "cpu.max", "150000 100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") == 1.5


def test_v2_quota_of_an_ancestor_applies_when_smaller(tmp_path: Path) -> None:
    """A parent cgroup's tighter limit binds its children: the smallest limit on the path wins."""
    _write(tmp_path / "proc", "0::/pods/web\n")
    _write(tmp_path / "cg" / "pods" / "cpu.max", "100000 100000\n")
    _write(tmp_path / "cg" / "pods" / "web" / "cpu.max", "max 100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") == 1.0


def test_v2_max_everywhere_is_no_quota(tmp_path: Path) -> None:
    _write(tmp_path / "proc", "0::/pods/web\n")
    _write(tmp_path / "cg" / "pods" / "web" / "cpu.max", "max 100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") is None


def test_v1_quota_is_cfs_quota_over_period(tmp_path: Path) -> None:
    """cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us under the cpu controller's mount."""
    _write(tmp_path / "proc", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    folder = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    _write(folder / "cpu.cfs_quota_us", "250000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") == 2.5


def test_v1_quota_at_the_mount_root_inside_a_container(tmp_path: Path) -> None:
    """In a container's cgroup namespace the listed path is not under the mount: its root is the
    container's own cgroup."""
    _write(tmp_path / "proc", "3:cpu,cpuacct:/docker/abc\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") == 0.5


def test_v1_unlimited_quota_is_none(tmp_path: Path) -> None:
    _write(tmp_path / "proc", "1:cpu:/\n0::/\n")
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path / "cg", tmp_path / "proc") is None


def test_no_cgroup_file_is_no_quota(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "cg", tmp_path / "missing") is None


# ---------------------------------------------------------------------- plan_cpu_threads


def test_threads_follow_the_cpus_allowed() -> None:
    plan = plan_cpu_threads(cpus=3, quota=None, environ={}, torch_loaded=False)
    assert (plan.threads, plan.threads_from) == (3, "cpus")


def test_a_quota_below_the_cpus_caps_the_threads_rounded_down() -> None:
    """A 64-CPU host with a 2.5-CPU quota runs 2 threads, not 64: a team wider than its quota is
    throttled mid-step."""
    plan = plan_cpu_threads(cpus=64, quota=2.5, environ={}, torch_loaded=False)
    assert (plan.threads, plan.threads_from) == (2, "quota")


def test_a_team_is_fixed_where_the_neighbours_cannot_be_measured() -> None:
    """Without /proc/stat (not Linux) no governor could read the CPUs: the team stays as sized."""
    plan = plan_cpu_threads(cpus=8, quota=None, environ={}, torch_loaded=False, measurable=False)
    assert (plan.threads, plan.adaptive, plan.wait_policy) == (8, False, "passive")


def test_a_quota_under_one_cpu_still_runs_one_thread() -> None:
    assert plan_cpu_threads(cpus=8, quota=0.5, environ={}, torch_loaded=False).threads == 1


def test_a_quota_above_the_cpus_changes_nothing() -> None:
    plan = plan_cpu_threads(cpus=2, quota=4.0, environ={}, torch_loaded=False)
    assert (plan.threads, plan.threads_from) == (2, "cpus")


def test_omp_num_threads_in_the_environment_is_kept() -> None:
    plan = plan_cpu_threads(cpus=8, quota=2.0, environ={"OMP_NUM_THREADS": "5"}, torch_loaded=False)
    assert (plan.threads, plan.threads_from) == (5, "OMP_NUM_THREADS")


def test_an_unreadable_omp_num_threads_is_replaced() -> None:
    plan = plan_cpu_threads(cpus=4, quota=None, environ={"OMP_NUM_THREADS": "4,2"}, torch_loaded=False)
    assert (plan.threads, plan.threads_from) == (4, "cpus")


def test_threads_given_win_over_the_environment() -> None:
    plan = plan_cpu_threads(cpus=8, quota=None, environ={"OMP_NUM_THREADS": "5"}, torch_loaded=False, threads=3)
    assert (plan.threads, plan.threads_from) == (3, "argument")


def test_a_team_sized_by_the_cpus_adapts_and_keeps_the_spinning_default() -> None:
    """Spinning is the fastest alone; beside busy processes the governor narrows the team."""
    plan = plan_cpu_threads(cpus=2, quota=None, environ={}, torch_loaded=False)
    assert (plan.adaptive, plan.wait_policy, plan.wait_policy_set) == (True, "spinning", False)


@pytest.mark.parametrize(
    ("cpus", "quota", "environ", "threads"),
    [
        (64, 2.5, {}, None),  # sized by a quota
        (8, None, {"OMP_NUM_THREADS": "4"}, None),  # sized by the user's environment
        (8, None, {}, 4),  # sized by the caller
        (1, None, {}, None),  # one CPU: nothing to narrow
    ],
)
def test_a_fixed_team_sleeps_when_idle(
    cpus: int, quota: float | None, environ: dict[str, str], threads: int | None
) -> None:
    plan = plan_cpu_threads(cpus=cpus, quota=quota, environ=environ, torch_loaded=False, threads=threads)
    assert (plan.adaptive, plan.wait_policy, plan.wait_policy_set) == (False, "passive", True)


@pytest.mark.parametrize("name", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"])
def test_a_wait_variable_already_set_is_kept(name: str) -> None:
    plan = plan_cpu_threads(cpus=8, quota=2.0, environ={name: "7"}, torch_loaded=False)
    assert (plan.wait_policy, plan.wait_policy_set) == (f"set by {name}=7", False)


def test_once_torch_is_loaded_the_policy_cannot_change() -> None:
    plan = plan_cpu_threads(cpus=8, quota=2.0, environ={}, torch_loaded=True)
    assert (plan.wait_policy, plan.wait_policy_set) == ("spinning", False)


def test_describe_names_threads_cpus_quota_and_policy() -> None:
    line = plan_cpu_threads(cpus=64, quota=2.5, environ={}, torch_loaded=False).describe()
    assert line == (
        "CPU threads: 2 (64 CPUs allowed, CPU quota 2.5, from the quota); "
        "OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, set by batchkit)"
    )


def test_describe_says_an_adaptive_team_narrows() -> None:
    line = plan_cpu_threads(cpus=2, quota=None, environ={}, torch_loaded=False).describe()
    assert line == (
        "CPU threads: 2 (2 CPUs allowed, no CPU quota), fewer while other processes use the CPUs; "
        "OpenMP threads spin when idle (the runtime's default)"
    )


# ---------------------------------------------------------------------- ThreadGovernor


class _Meter:
    """A fake clock and CPU meter: ``advance(seconds, others, own)`` moves time on with the
    neighbours using ``others`` CPUs and this process ``own``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def read(self) -> tuple[float, float]:
        return self.busy, self.own


def _governor(meter: _Meter, applied: list[int], max_threads: int = 2) -> _cpu.ThreadGovernor:
    return _cpu.ThreadGovernor(
        max_threads, 0.5, clock=lambda: meter.now, read=meter.read, set_threads=applied.append, cpus=max_threads
    )


def test_the_first_tick_sizes_the_calling_threads_team_to_the_most() -> None:
    applied: list[int] = []
    assert _governor(_Meter(), applied).tick() == 2
    assert applied == [2]


def test_a_busy_neighbour_narrows_the_team_after_two_readings_agree() -> None:
    meter, applied = _Meter(), list[int]()
    governor = _governor(meter, applied)
    governor.tick()
    meter.advance(0.5, others=0.7, own=1.3)  # one busy process beside a team of 2
    assert governor.tick() == 2  # one reading: not yet
    meter.advance(0.5, others=0.7, own=1.3)
    assert governor.tick() == 1
    assert applied == [2, 1]
    assert governor.others == pytest.approx(0.7)


def test_the_team_widens_again_when_the_neighbour_goes() -> None:
    meter, applied = _Meter(), list[int]()
    governor = _governor(meter, applied)
    governor.tick()
    for others, own in ((1.0, 1.0), (1.0, 1.0), (0.0, 1.0), (0.0, 1.0)):
        meter.advance(0.5, others, own)
        governor.tick()
    assert applied == [2, 1, 2]


def test_one_burst_does_not_resize_the_team() -> None:
    meter, applied = _Meter(), list[int]()
    governor = _governor(meter, applied)
    governor.tick()
    for others in (1.0, 0.0, 1.0, 0.0):
        meter.advance(0.5, others, own=1.0)
        governor.tick()
    assert applied == [2]


def test_readings_wait_for_the_interval() -> None:
    reads: list[int] = []
    meter = _Meter()

    def read() -> tuple[float, float]:
        reads.append(1)
        return meter.read()

    governor = _cpu.ThreadGovernor(2, 0.5, clock=lambda: meter.now, read=read, set_threads=lambda n: None, cpus=2)
    governor.tick()
    meter.advance(0.1, 0.0, 1.0)
    governor.tick()
    meter.advance(0.4, 0.0, 1.0)
    governor.tick()
    assert len(reads) == 2


@pytest.mark.parametrize(("others", "threads"), [(0.0, 4), (0.4, 4), (0.6, 3), (1.4, 3), (2.6, 1), (9.0, 1)])
def test_the_team_is_the_cpus_the_neighbours_leave_rounded(others: float, threads: int) -> None:
    governor = _cpu.ThreadGovernor(4, clock=lambda: 0.0, read=lambda: (0.0, 0.0), set_threads=lambda n: None, cpus=4)
    assert governor.threads_for(others) == threads


def test_a_new_stepping_thread_gets_its_team_sized_too() -> None:
    """OpenMP keeps the thread count per thread: the engine thread that steps next is sized."""
    applied: list[int] = []
    governor = _governor(_Meter(), applied)
    governor.tick()
    worker = threading.Thread(target=governor.tick)
    worker.start()
    worker.join(timeout=10)
    assert applied == [2, 2]


def test_adapt_without_a_governor_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu, "_governor", None)
    assert batchkit.adapt_cpu_threads() is None


def test_adapt_ticks_the_process_governor(monkeypatch: pytest.MonkeyPatch) -> None:
    applied: list[int] = []
    monkeypatch.setattr(_cpu, "_governor", _governor(_Meter(), applied))
    assert batchkit.adapt_cpu_threads() == 2
    assert applied == [2]


def test_cpu_seconds_reads_this_machine() -> None:
    """The real meter: busy CPU seconds since boot, and this process's own, both counting up."""
    if not Path("/proc/stat").exists():
        pytest.skip("needs Linux's /proc/stat")
    busy, own = _cpu._cpu_seconds()
    sum(range(200_000))  # some CPU time of our own
    busy2, own2 = _cpu._cpu_seconds()
    assert 0 < busy <= busy2
    assert 0 < own <= own2


# ---------------------------------------------------------------------- configure_cpu_threads


class _FakeTorch:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def set_num_threads(self, n: int) -> None:
        self.threads.append(n)


def test_configure_writes_a_fixed_team_into_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu, "allowed_cpus", lambda: 16)
    monkeypatch.setattr(_cpu, "cpu_quota", lambda: 3.0)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env: dict[str, str] = {}
    plan = configure_cpu_threads(environ=env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}
    assert (plan.threads, plan.cpus, plan.quota) == (3, 16, 3.0)


def test_configure_keeps_what_the_environment_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}
    configure_cpu_threads(environ=env)
    assert env == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}


def test_configure_sets_torch_threads_when_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeTorch()
    monkeypatch.setattr(_cpu, "allowed_cpus", lambda: 4)
    monkeypatch.setattr(_cpu, "cpu_quota", lambda: None)
    monkeypatch.setitem(sys.modules, "torch", fake)
    env: dict[str, str] = {}
    plan = configure_cpu_threads(environ=env)
    assert fake.threads == [4]
    assert plan.wait_policy == "spinning"
    assert env == {"OMP_NUM_THREADS": "4"}


def test_configure_of_this_process_starts_the_governor_for_an_adaptive_team(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu, "allowed_cpus", lambda: 2)
    monkeypatch.setattr(_cpu, "cpu_quota", lambda: None)
    monkeypatch.setattr(_cpu, "_governor", None)
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch())
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    plan = configure_cpu_threads()
    assert plan.adaptive
    assert isinstance(_cpu._governor, _cpu.ThreadGovernor)
    assert _cpu._governor.max_threads == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_configure_refuses_a_bad_thread_count(bad: Any) -> None:
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        configure_cpu_threads(threads=bad, environ={})


def test_top_level_exports_configure_cpu_threads() -> None:
    assert batchkit.configure_cpu_threads is configure_cpu_threads
    assert batchkit.adapt_cpu_threads is _cpu.adapt_cpu_threads
    assert batchkit.CpuThreads is _cpu.CpuThreads
    assert batchkit.ThreadGovernor is _cpu.ThreadGovernor


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_torch_loaded_afterwards_runs_the_chosen_threads_on_one_allowed_cpu() -> None:
    """End to end, in a fresh process pinned to one CPU: torch, imported after the call, runs one
    thread with OMP_WAIT_POLICY=PASSIVE in its environment."""
    pytest.importorskip("torch")
    code = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "import batchkit\n"
        "plan = batchkit.configure_cpu_threads()\n"
        "import torch\n"
        "print(plan.threads, torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "1", "PASSIVE"]
