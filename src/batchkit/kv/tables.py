"""BlockTables: every live sequence's block table as one row of a 2-D numpy int32 array.

A sans-I/O core. Row ``r`` holds ``num_blocks[r]`` block ids followed by the null block 0, and
``lens[r]`` tokens; token ``p`` of a row lives in slot ``table[r, p // block_size] * block_size
+ p % block_size``. Rows are recycled, and the arrays double when they run out of rows or
columns, so that per-step work on many sequences is a few vectorised operations.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BlockTables"]


class BlockTables:
    """Dense block tables, token counts and block counts, one row per sequence.

    Args:
        block_size: token slots per block.

    The arrays (``table``, ``lens``, ``num_blocks``) are public for vectorised reads and
    writes by the allocator; they are replaced when they grow, so read them afresh after
    :meth:`new_row` or :meth:`ensure_cols`.
    """

    __slots__ = ("_free_rows", "_next_row", "block_size", "lens", "num_blocks", "table")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.table = np.zeros((8, 8), dtype=np.int32)
        self.lens = np.zeros(8, dtype=np.int64)  # tokens per row
        self.num_blocks = np.zeros(8, dtype=np.int32)  # blocks per row
        self._free_rows: list[int] = []
        self._next_row = 0

    def new_row(self) -> int:
        """An empty row for a new sequence."""
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        if row >= self.table.shape[0]:
            rows = 2 * self.table.shape[0]
            self.table = _grown(self.table, (rows, self.table.shape[1]))
            self.lens = _grown(self.lens, (rows,))
            self.num_blocks = _grown(self.num_blocks, (rows,))
        self._next_row += 1
        return row

    def release_row(self, row: int) -> None:
        """Empty a row and keep it for the next :meth:`new_row`."""
        self.table[row, : self.num_blocks[row]] = 0
        self.lens[row] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def detach(self, row: int) -> None:
        """Point the row's blocks at the null block, keeping its counts (a swapped-out sequence)."""
        self.table[row, : self.num_blocks[row]] = 0

    def attach(self, row: int, blocks: np.ndarray, start: int = 0) -> None:
        """Give a detached row its (new) blocks back, from its block ``start`` on (those before
        stay the null block)."""
        self.table[row, start : start + blocks.size] = blocks

    def ensure_cols(self, num_blocks: int) -> None:
        """Make room for tables of ``num_blocks`` blocks."""
        cols = self.table.shape[1]
        if num_blocks > cols:
            while cols < num_blocks:
                cols *= 2
            self.table = _grown(self.table, (self.table.shape[0], cols))

    def blocks(self, row: int) -> np.ndarray:
        """The row's blocks, in order (a view)."""
        view: np.ndarray = self.table[row, : self.num_blocks[row]]
        return view

    def set_blocks(self, row: int, blocks: np.ndarray | list[int], num_tokens: int) -> None:
        """Fill an empty row with a sequence's blocks and its token count."""
        n = len(blocks)
        self.ensure_cols(n)
        self.table[row, :n] = blocks
        self.num_blocks[row] = n
        self.lens[row] = num_tokens

    def extend_row(self, row: int, num_blocks: int, blocks: np.ndarray) -> None:
        """Append ``blocks`` to one row that holds ``num_blocks`` blocks now (the one-sequence
        growth path: plain ints, no index arrays)."""
        end = num_blocks + blocks.size
        if end > self.table.shape[1]:
            self.ensure_cols(end)
        self.table[row, num_blocks:end] = blocks
        self.num_blocks[row] = end

    def row_slots(self, row: int, start: int, count: int) -> np.ndarray:
        """Slots (int64) of positions ``start..start+count-1`` of one row."""
        bs = self.block_size
        if count == 1:  # a decode step: one table read, no index arrays
            return np.array([int(self.table[row, start // bs]) * bs + start % bs], dtype=np.int64)
        pos = np.arange(start, start + count, dtype=np.int64)
        out: np.ndarray = self.table[row].take(pos // bs).astype(np.int64)
        out *= bs
        out += pos % bs
        return out

    def add_blocks(self, rows: np.ndarray, counts: np.ndarray | None, blocks: np.ndarray) -> None:
        """Append ``counts[i]`` of ``blocks`` (in order) to row ``rows[i]``, for each ``i``
        (``counts`` None: one block each)."""
        if not blocks.size:
            return
        nb = self.num_blocks[rows]
        if counts is None:  # one block each: the common decode case
            self.ensure_cols(int(nb.max()) + 1)
            self.table[rows, nb] = blocks
            self.num_blocks[rows] = nb + 1
            return
        if rows.size == 1:  # one sequence (append_slots)
            start = int(nb[0])
            end = start + blocks.size
            self.ensure_cols(end)
            self.table[rows[0], start:end] = blocks
            self.num_blocks[rows] = end
            return
        self.ensure_cols(int((nb + counts).max()))
        rep = np.repeat(np.arange(rows.size), counts)
        first = np.cumsum(counts) - counts  # index in ``blocks`` of each row's first new block
        self.table[rows[rep], nb[rep] + (np.arange(blocks.size) - first[rep])] = blocks
        self.num_blocks[rows] = nb + counts

    def slots(self, rows: np.ndarray, starts: np.ndarray, counts: int | np.ndarray) -> np.ndarray:
        """Slots (int64) of positions ``starts[i]..starts[i]+counts[i]-1`` of row ``rows[i]``,
        row after row."""
        bs = self.block_size
        if isinstance(counts, int) and counts == 1:
            pos = starts
            idx = rows
        elif isinstance(counts, int) and rows.size == 1:  # one sequence (append_slots, slot_mapping)
            pos = np.arange(starts[0], starts[0] + counts, dtype=np.int64)
            idx = rows[0]
        else:
            c = np.broadcast_to(np.asarray(counts, dtype=np.int64), rows.shape)
            rep = np.repeat(np.arange(rows.size), c)
            first = np.cumsum(c) - c
            pos = starts[rep] + (np.arange(rep.size) - first[rep])
            idx = rows[rep]
        out: np.ndarray = self.table[idx, pos // bs].astype(np.int64) * bs + pos % bs
        return out

    def padded(self, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        """The rows' block tables as one ``[len(rows), width]`` int32 array (a copy), padded
        with the null block 0; ``width`` defaults to the longest.

        Raises:
            ValueError: ``width`` is narrower than the longest of the rows.
        """
        need = int(self.num_blocks[rows].max()) if rows.size else 0
        width = need if width is None else width
        if width < need:
            raise ValueError(f"width={width} is narrower than the longest block table ({need})")
        out = np.zeros((rows.size, width), dtype=np.int32)
        k = min(width, self.table.shape[1])
        out[:, :k] = self.table[rows, :k]
        return out

    def __repr__(self) -> str:
        return f"<BlockTables rows={self._next_row - len(self._free_rows)} block_size={self.block_size}>"


def _grown(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=arr.dtype)
    out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out
