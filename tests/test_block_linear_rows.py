"""The block linear kernel (csrc/block_linear_cpu.cpp) at every row count: one and two rows take the
in-register tile, three or more (on AVX2) the decoded-weights tiles of 4 rows x 3 weight rows with their
leftovers; every row must get the same bits whatever the row count, and the right value."""

from __future__ import annotations

import pytest
import torch

from treespec import ops
from treespec.core.blocks import BlockMatrix, BlockWeights

pytestmark = pytest.mark.skipif(not ops.available("cpu"), reason="treespec's compiled CPU ops did not build")


def _random_blocks(kind: str, N: int, K: int, generator: torch.Generator) -> BlockWeights:
    B = K // 32

    def half_values(scale: float) -> torch.Tensor:
        return (torch.randn(N, B, generator=generator) * scale).half().float().contiguous()

    if kind == "q4_1":
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=generator)
        return BlockWeights(q, half_values(0.02), half_values(0.1))
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    return BlockWeights(q, half_values(0.01), None)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("K", [32, 576, 4096])  # 4096: more weight rows per task than one decoded group
def test_every_row_count_gives_the_same_bits(kind, K):
    generator = torch.Generator().manual_seed(K)
    N, rows = 70, 23  # 70 outputs: tasks of 32, 32 and 6 columns, leftovers of 1 and 2 weight rows
    blocks = _random_blocks(kind, N, K, generator)
    matrix = BlockMatrix(blocks)
    x = torch.randn(rows, K, generator=generator)
    full = matrix(x)
    reference = x.double() @ blocks.dequantize().double().T
    assert (full.double() - reference).abs().max().item() < 1e-5 * reference.abs().max().item() + 1e-6
    for count in range(1, 11):
        for start in {0, 1, rows - count}:
            part = matrix(x[start : start + count])
            assert torch.equal(part, full[start : start + count]), (count, start)
