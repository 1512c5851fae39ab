"""SwapSpace: the CPU blocks that hold swapped-out sequences' KV, as a sans-I/O core.

It hands out and takes back CPU block ids and counts swaps; the copies themselves are data the
caller returns to its runtime ((device, cpu) pairs for ``PagedKVCache.swap_blocks``).
"""

from __future__ import annotations

__all__ = ["SwapSpace"]


class SwapSpace:
    """A free list of CPU block ids ``0..num_cpu_blocks-1`` and the swap counters.

    Args:
        num_cpu_blocks: blocks in the CPU pool (0: no swapping; the caller validates).
    """

    __slots__ = ("_free", "num_cpu_blocks", "num_swapped", "swaps_in", "swaps_out")

    def __init__(self, num_cpu_blocks: int) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self._free = list(range(num_cpu_blocks - 1, -1, -1))  # block 0 is popped first
        #: Sequences swapped out now.
        self.num_swapped = 0
        self.swaps_out = 0
        self.swaps_in = 0

    @property
    def num_free(self) -> int:
        """CPU blocks free now."""
        return len(self._free)

    def can_swap_out(self, num_blocks: int) -> bool:
        """Whether a sequence of ``num_blocks`` device blocks fits in the CPU pool now."""
        return num_blocks <= len(self._free)

    def swap_out(self, num_blocks: int) -> list[int]:
        """CPU blocks for one sequence's ``num_blocks`` device blocks (check :meth:`can_swap_out`)."""
        free = self._free
        out = [free.pop() for _ in range(num_blocks)]
        self.num_swapped += 1
        self.swaps_out += 1
        return out

    def swap_in(self, cpu_blocks: list[int]) -> None:
        """A sequence's CPU blocks come back to the free list: it is resident again."""
        self._free.extend(cpu_blocks)
        self.num_swapped -= 1
        self.swaps_in += 1

    def discard(self, cpu_blocks: list[int]) -> None:
        """A swapped-out sequence was freed: its CPU blocks come back without a swap-in."""
        self._free.extend(cpu_blocks)
        self.num_swapped -= 1

    def __repr__(self) -> str:
        return f"<SwapSpace cpu_blocks={self.num_cpu_blocks} free={len(self._free)} swapped={self.num_swapped}>"
