"""What a job tells its caller: :class:`JobProgress` after each commit, :class:`JobReport` at
the end (counts, rates, the cost per 1k tokens, where the output and the failures went)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JobProgress", "JobReport"]


@dataclass(frozen=True, slots=True)
class JobProgress:
    """Counts after a commit (this run only), passed to ``on_commit``."""

    succeeded: int
    failed: int
    skipped: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class JobReport:
    """What a run did. Counts are this run's, except ``dead_letters`` (the whole dead-letter file).

    ``items = succeeded + failed``; ``skipped`` were done by an earlier run; ``duplicates`` repeat an
    id seen earlier in the input (the first occurrence is the one processed). ``stopped`` says why
    the run stopped before the end of its input (``max_failures``, ``fail_fast``), or is None.
    ``output`` is the file that holds the results: for a ``.parquet`` sink the Parquet file, or
    its JSONL journal (``<sink>.jsonl``) when the run stopped before writing it.
    """

    output: str
    dead_letter: str
    succeeded: int
    failed: int
    malformed: int
    skipped: int
    duplicates: int
    retries: int
    dead_letters: int
    wall_s: float
    tokens: int | None
    price_per_hour: float | None
    max_in_flight: int
    peak_in_flight: int
    stopped: str | None = None

    @property
    def items(self) -> int:
        """Items finished by this run: ``succeeded + failed``."""
        return self.succeeded + self.failed

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        if self.tokens is None:
            return None
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost(self) -> float | None:
        """``price_per_hour * wall_s / 3600``, or None without a price."""
        return None if self.price_per_hour is None else self.price_per_hour * self.wall_s / 3600

    @property
    def cost_per_1k_tokens(self) -> float | None:
        """``C_token * 1000`` with ``C_token = C_gpu * T_run / N_tokens``; None without a price or tokens."""
        if self.cost is None or not self.tokens:
            return None
        return self.cost / self.tokens * 1000

    @property
    def exit_code(self) -> int:
        """0 when every item of the job has an output, 1 when the dead-letter file holds any or
        the run stopped early."""
        return 1 if self.dead_letters or self.stopped is not None else 0

    def summary(self) -> str:
        """A few lines for people: counts, rates, cost, and where the failures went."""
        lines = [
            f"{self.items:,} items in {self.wall_s:.2f} s ({self.items_per_s:,.1f} items/s): "
            f"{self.succeeded:,} succeeded, {self.failed:,} failed ({self.malformed:,} malformed), "
            f"{self.skipped:,} skipped (already done), {self.duplicates:,} duplicate ids, {self.retries:,} retries",
        ]
        if self.tokens is not None:
            lines.append(f"{self.tokens:,} tokens ({self.tokens_per_s or 0:,.1f} tokens/s)")
        if self.cost is not None:
            per_1k = self.cost_per_1k_tokens
            tail = f", {per_1k:.6f} per 1k tokens" if per_1k is not None else " (no token counts: no cost per token)"
            lines.append(f"cost {self.cost:.6f} at {self.price_per_hour:g} per hour{tail}")
        lines.append(f"output: {self.output}")
        if self.dead_letters:
            lines.append(f"{self.dead_letters:,} dead letters (with their errors) in {self.dead_letter}")
        if self.stopped is not None:
            lines.append(f"stopped early: {self.stopped}")
        return "\n".join(lines)
