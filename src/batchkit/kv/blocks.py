"""BlockPool: the device blocks of a paged KV cache, their reference counts and the free stack.

A sans-I/O core with no tensors: it only counts. Block 0 is the null block (padding in block
tables), never handed out. Free blocks are a stack in a numpy int32 array with low ids on top,
so that allocation order is stable; reference counts are a numpy int32 array indexed by block.

The pool knows nothing of the prefix cache: :meth:`release` hands back the blocks whose last
reference went, and the caller decides which of them stay cached (kept out of the pool) and
which return with :meth:`push_free`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NULL_BLOCK", "BlockPool"]

NULL_BLOCK = 0


class BlockPool:
    """Reference counts and a free stack over blocks ``1..num_blocks-1``.

    Args:
        num_blocks: blocks including the null block 0 (>= 2; the caller validates).
    """

    __slots__ = ("_free", "_num_free", "num_blocks", "num_shared", "ref")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # The top of the stack is at _num_free - 1: block 1 is handed out first.
        self._free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)
        self._num_free = num_blocks - 1
        #: Reference count per block (index 0, the null block, stays 0).
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        #: References beyond the first, over all blocks: 0 means no block is shared.
        self.num_shared = 0

    @property
    def total_blocks(self) -> int:
        """Blocks that can ever be handed out (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks on the free stack (held by nobody, cached by nobody)."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return int(np.count_nonzero(self.ref))

    def free_block_ids(self) -> list[int]:
        """The free stack, bottom first (a copy)."""
        out: list[int] = self._free[: self._num_free].tolist()
        return out

    def pop_free(self, n: int) -> np.ndarray:
        """Pop ``n`` blocks (``n <= num_free``) off the free stack; their counts are not touched."""
        top = self._num_free
        out: np.ndarray = self._free[top - n : top][::-1].copy()
        self._num_free = top - n
        return out

    def push_free(self, blocks: np.ndarray) -> None:
        """Put blocks nobody holds back on the free stack (the first one listed comes out first)."""
        k = blocks.size
        self._free[self._num_free : self._num_free + k] = blocks[::-1]
        self._num_free += k

    def hold(self, blocks: np.ndarray) -> None:
        """Set the reference count of blocks just handed out to 1."""
        self.ref.put(blocks, 1)  # cheaper than fancy assignment for a few blocks

    def share(self, blocks: np.ndarray | list[int]) -> None:
        """Add one reference to each of these (distinct) blocks; a block that had none (a cached
        block coming back into use) is held, not shared."""
        arr = np.asarray(blocks, dtype=np.int64)
        if arr.size:
            self.num_shared += int(np.count_nonzero(self.ref[arr] > 0))
            self.ref[arr] += 1

    def release(self, blocks: np.ndarray) -> np.ndarray:
        """Drop one reference from each of these (distinct) blocks; return those nobody holds now.

        The returned blocks are on no list: the caller pushes them back with :meth:`push_free`
        or keeps them (cached).
        """
        if not blocks.size:
            return blocks
        r = self.ref[blocks] - 1
        self.ref[blocks] = r
        self.num_shared -= int(np.count_nonzero(r > 0))
        zero: np.ndarray = blocks[r == 0]
        return zero

    def __repr__(self) -> str:
        return f"<BlockPool blocks={self.total_blocks} free={self._num_free} shared={self.num_shared}>"
