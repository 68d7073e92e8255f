"""A sequence's KV pages in order, as a growing int32 array.

Every step copies each scheduled sequence's block table into the batch's [S, width] table. From a Python list
that is a conversion per entry: 32 sequences at 64K tokens (4,096 pages each) took ~2 ms of host time a step
(`python bench/host_batch.py`). From this array it is one memcpy a row.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    __slots__ = ("_pages", "_len")

    def __init__(self) -> None:
        self._pages = np.empty(16, dtype=np.int32)
        self._len = 0

    @property
    def array(self) -> np.ndarray:
        """The pages as an int32 view (valid until the table next grows)."""
        return self._pages[: self._len]

    def append(self, page: int) -> None:
        if self._len == len(self._pages):
            grown = np.empty(2 * len(self._pages), dtype=np.int32)
            grown[: self._len] = self._pages
            self._pages = grown
        self._pages[self._len] = page
        self._len += 1

    def clear(self) -> None:
        self._len = 0

    def tolist(self) -> list[int]:
        return self.array.tolist()

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return iter(self.tolist())

    def __getitem__(self, i: int) -> int:
        return int(self.array[i])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.tolist() == other.tolist()
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"
