"""What every benchmark in benchmarks/ shares: its common options, its machine line, its timings
and its JSON record.

A script builds its parser with ``parser(__doc__)`` (``--repeat``, ``--warmup``, ``--json``, then
its own options; a script may declare a common option again to give it its own default and help),
calls ``record = start(args)`` after parsing, which prints the machine line first, adds each
figure it prints with ``record.add(...)`` and ends with ``record.write()``, which writes the JSON
record where ``--json`` says (and nothing without it).

Timings: ``measure`` runs a callable ``warmup`` times unrecorded, then ``repeat`` times, and
returns what each recorded run returned; ``interleave`` does the same for several callables, one
of each per round, so that drift on a shared machine falls on all of them alike; ``per_call``
times ``calls`` calls of a callable as one run. ``Summary`` is the median and range of a list of
figures. ``busy_processes(n)`` keeps ``n`` spinning processes beside the block it wraps.

Standard library only: the peer benchmarks run their children in another virtual environment.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# The CPU features the kernels batchkit picks depend on (bfloat16 matmuls, AMX tiles, AVX2).
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


# --------------------------------------------------------------------------- options


class BenchParser(argparse.ArgumentParser):
    """An argument parser that refuses (status 2) a ``--repeat`` below 1 or a ``--warmup`` below 0,
    and, where ``once`` is set (a script that measures once), any but ``--repeat 1 --warmup 0``
    rather than accept and ignore them."""

    once = False

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "repeat", 1) < 1:
            self.error(f"--repeat must be at least 1, got {parsed.repeat}")
        if getattr(parsed, "warmup", 0) < 0:
            self.error(f"--warmup must be at least 0, got {parsed.warmup}")
        if self.once and (getattr(parsed, "repeat", 1) != 1 or getattr(parsed, "warmup", 0) != 0):
            self.error(f"{self.prog} measures once: it takes --repeat 1 and --warmup 0 only")
        return parsed, rest


def parser(doc: str | None, *, once: bool = False, **kwargs: Any) -> BenchParser:
    """An argument parser described by the first paragraph of ``doc``, with the common options.

    ``--repeat`` (recorded runs of the measurement, default 1), ``--warmup`` (unrecorded runs
    before them, default 0) and ``--json PATH``. A script adds its own options, and declares
    ``--repeat`` or ``--warmup`` again where it wants another default or its own help (the later
    declaration wins). ``once``: the script measures once, and refuses other counts (see
    BenchParser). ``kwargs`` go to ``argparse.ArgumentParser`` (a ``description`` there replaces
    the first paragraph).
    """
    kwargs.setdefault("description", (doc or "").strip().split("\n\n")[0] or None)
    ap = BenchParser(conflict_handler="resolve", **kwargs)
    ap.once = once
    ap.add_argument("--repeat", type=int, default=1, help="recorded runs of the measurement (default 1)")
    ap.add_argument("--warmup", type=int, default=0, help="unrecorded runs before them (default 0)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure, its settings and the machine here")
    return ap


# --------------------------------------------------------------------------- the machine


@dataclass(frozen=True, slots=True)
class Machine:
    """What a figure was measured on."""

    cpu: str
    flags: dict[str, bool]  # each of CPU_FLAGS: does the CPU report it
    cores_usable: int  # this process's CPU affinity
    cores: int
    load_average: tuple[float, float, float]
    python: str
    torch: str | None  # the installed torch's version (not imported), None without torch
    system: str

    def line(self) -> str:
        """One line: ``machine: <cpu> | amx_bf16 no, ... | 2 of 2 cores usable | load ... | ...``."""
        flags = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in self.flags.items())
        load = " ".join(f"{x:.2f}" for x in self.load_average)
        torch = f"torch {self.torch}" if self.torch else "no torch"
        return (
            f"machine: {self.cpu} | {flags} | {self.cores_usable} of {self.cores} cores usable | "
            f"load {load} | {torch} | python {self.python} | {self.system}"
        )


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); elsewhere platform's guess."""
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def machine() -> Machine:
    """This machine now: CPU model and flags, usable cores, load average, python and torch."""
    model, flags = _cpuinfo()
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    # The version from the installed metadata: importing torch would cost a script that needs none.
    torch = None
    if importlib.util.find_spec("torch") is not None:
        try:
            torch = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch = "unknown version"
    return Machine(
        cpu=model,
        flags={name: name in flags for name in CPU_FLAGS},
        cores_usable=usable,
        cores=cores,
        load_average=(load[0], load[1], load[2]),
        python=platform.python_version(),
        torch=torch,
        system=f"{platform.system()} {platform.machine()}",
    )


# --------------------------------------------------------------------------- timings


@dataclass(frozen=True, slots=True)
class Summary:
    """The median and range of some figures (one per run)."""

    median: float
    low: float
    high: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        """Raises ValueError on no values."""
        runs = tuple(float(v) for v in values)
        if not runs:
            raise ValueError("Summary.of() needs at least one value")
        return cls(statistics.median(runs), min(runs), max(runs), runs)

    def format(self, spec: str = ".1f", scale: float = 1.0) -> str:
        """``"12.3 (11.9-13.0, 5 runs)"``, each figure times ``scale``; one run: ``"12.3 (1 run)"``."""
        med = format(self.median * scale, spec)
        if len(self.runs) == 1:
            return f"{med} (1 run)"
        return f"{med} ({format(self.low * scale, spec)}-{format(self.high * scale, spec)}, {len(self.runs)} runs)"


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of some figures, nearest rank; NaN for none."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def median(values: Iterable[float]) -> float:
    """The median of some figures (Raises ValueError on none)."""
    return Summary.of(values).median


def measure(run: Callable[[], T], repeat: int, warmup: int = 0) -> list[T]:
    """``run()`` ``warmup`` times, its results dropped, then ``repeat`` times: those results."""
    for _ in range(warmup):
        run()
    return [run() for _ in range(repeat)]


def interleave(runs: Mapping[str, Callable[[], T]], repeat: int, warmup: int = 0) -> dict[str, list[T]]:
    """Each of ``runs`` once per round, in order, ``warmup`` unrecorded rounds then ``repeat``
    recorded ones: each name's results, one per recorded round."""
    out: dict[str, list[T]] = {name: [] for name in runs}
    for r in range(warmup + repeat):
        for name, run in runs.items():
            result = run()
            if r >= warmup:
                out[name].append(result)
    return out


def poisson_arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Seconds from the start of each arrival of a Poisson process at ``rate`` per second, until
    one falls at or past ``seconds`` (that one included): an open loop's schedule."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        out.append(t)
    return out


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU (``while True: pass``) while the block runs: the busy
    neighbours of the contention benchmarks."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # let the scheduler place them
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """``fn()``'s wall seconds and result."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


# --------------------------------------------------------------------------- the record


@dataclass
class Record:
    """The figures of one benchmark run, with its settings and the machine, for ``--json``."""

    script: str
    settings: dict[str, Any]
    machine: Machine
    path: str | None = None
    started: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat())
    figures: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self, name: str, value: float | Summary | Iterable[float] | str | None, unit: str = "", **settings: Any
    ) -> None:
        """One figure: a number, a Summary, the runs of one (summarized here) or a verdict string;
        ``settings`` are what this figure alone depends on (its row, dtype, batch size)."""
        entry: dict[str, Any] = {"name": name, "unit": unit, **({"settings": settings} if settings else {})}
        if isinstance(value, Summary):
            entry.update(median=value.median, min=value.low, max=value.high, runs=list(value.runs))
        elif isinstance(value, (int, float, str)) or value is None:
            entry["value"] = value
        else:
            s = Summary.of(value)
            entry.update(median=s.median, min=s.low, max=s.high, runs=list(s.runs))
        self.figures.append(entry)

    def write(self) -> None:
        """Write the record to ``path`` as JSON (nothing where ``path`` is None)."""
        if self.path is None:
            return
        data = {
            "script": self.script,
            "started": self.started,
            "settings": self.settings,
            "machine": asdict(self.machine),
            "figures": self.figures,
        }
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def start(args: argparse.Namespace, script: str | None = None) -> Record:
    """Print the machine line (first, flushed) and return the run's record: ``args`` as its
    settings, ``--json`` as its path."""
    here = machine()
    print(here.line(), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    name = script or Path(sys.argv[0]).name
    return Record(script=name, settings=settings, machine=here, path=getattr(args, "json", None))
