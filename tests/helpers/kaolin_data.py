"""Kaolin 0.18's published test expectations (facts from its test suite), as tensors."""

from __future__ import annotations

import torch

# Two packed octrees (6 and 5 bytes); each row lists bits 7..0 of one byte.
_ROWS = [
    [0, 0, 0, 1, 0, 0, 0, 1],
    [0, 0, 0, 0, 0, 1, 1, 0],
    [0, 0, 1, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 0, 0, 0, 0],
    [0, 0, 1, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [0, 1, 0, 1, 0, 1, 0, 1],
]


def two_octrees() -> tuple[torch.Tensor, torch.Tensor]:
    octrees = torch.tensor(
        [sum(bit << (7 - i) for i, bit in enumerate(row)) for row in _ROWS], dtype=torch.uint8
    )
    return octrees, torch.tensor([6, 5], dtype=torch.int32)


TWO_OCTREES_PYRAMIDS = [[[1, 2, 3, 3, 0], [0, 1, 3, 6, 9]], [[1, 1, 3, 13, 0], [0, 1, 2, 5, 18]]]
TWO_OCTREES_EXSUM = [2, 4, 5, 6, 7, 8, 1, 4, 5, 13, 17]
TWO_OCTREES_POINTS = [
    [0, 0, 0],
    [0, 0, 0],
    [1, 0, 0],
    [0, 0, 1],
    [0, 1, 0],
    [3, 0, 1],
    [1, 1, 3],
    [1, 3, 1],
    [6, 1, 3],
    [0, 0, 0],
    [1, 1, 1],
    [3, 2, 2],
    [3, 2, 3],
    [3, 3, 2],
    [7, 4, 5],
    [6, 4, 6],
    [6, 4, 7],
    [6, 5, 6],
    [6, 5, 7],
    [7, 4, 6],
    [7, 4, 7],
    [7, 5, 6],
    [7, 5, 7],
    [6, 6, 4],
    [6, 7, 4],
    [7, 6, 4],
    [7, 7, 4],
]
