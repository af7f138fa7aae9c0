"""``count_items``: what packing needs to know of each item, counted on the device in one pass, against the
pooler's own mask and a count per item on the host."""

import pytest
import torch

from fused_vision import reference
from fused_vision.encoder.packed import ItemCounts, count_items

TABLE_ROWS = 40


def grid_ids(width: int, height: int, patches: int) -> torch.Tensor:
    """A row-major (x fastest) grid of width x height patches, then (-1, -1) padding up to ``patches``."""
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.full((patches, 2), -1, dtype=torch.int64)
    ids[: width * height] = torch.stack([x.flatten(), y.flatten()], dim=-1)
    return ids


def host_counts(ids: torch.Tensor, kernel: int, table_rows: int) -> tuple:
    """One item's counts the slow way: boolean indexing and the reference pooler's mask."""
    real = ids[~(ids == -1).all(dim=-1)]
    patches, hidden = ids.shape[0], 4
    length = patches // kernel**2
    padding = (ids == -1).all(dim=-1)
    pooled, mask = reference.pool_by_positions(torch.zeros(1, patches, hidden), ids[None], padding[None], length)
    outside = bool(((real < 0) | (real >= table_rows)).any())
    return real.shape[0], int(mask.sum()), outside


def test_items_of_several_patch_counts_are_counted_as_the_pooler_masks_them():
    generator = torch.Generator().manual_seed(0)
    items = [grid_ids(6, 3, 36), grid_ids(3, 3, 9), grid_ids(3, 6, 27), grid_ids(9, 3, 36), grid_ids(1, 2, 9)]
    shuffled = grid_ids(6, 6, 36)[torch.randperm(36, generator=generator)]  # any order of the grid's rows
    past = grid_ids(12, 3, 36)  # 4 x 1 blocks in an item of 4 slots, then padding at slot 0: fits
    too_wide = torch.tensor([[15, 0]] * 9)  # past the item's 1 slot: counted at slot 0, as the pooler does
    outside = grid_ids(3, 3, 9).clone()
    outside[4] = torch.tensor([TABLE_ROWS, 0])  # a real id past the table
    items += [shuffled, past, too_wide, outside]
    counts = count_items(items, 3, TABLE_ROWS)
    expected = [host_counts(ids, 3, TABLE_ROWS) for ids in items]
    assert counts == ItemCounts(*(tuple(column) for column in zip(*expected)))
    assert counts.pooled[-2] == 1 and counts.outside_table[-1] and not any(counts.outside_table[:-1])
    assert counts.part(1, 3) == ItemCounts(*(tuple(column[1:3]) for column in zip(*expected)))


def test_a_patch_count_the_kernel_does_not_divide_and_no_pooling_are_counted_as_stock_masks_them():
    counts = count_items([grid_ids(2, 2, 10)], 3, TABLE_ROWS)
    assert counts.real == (4,) and counts.pooled == (-1,), "stock's pooler raises on 10 patches: no count"
    ids = grid_ids(2, 2, 7)
    counts = count_items([ids], 1, TABLE_ROWS)
    assert counts.pooled == (3,) == (host_counts(ids, 1, TABLE_ROWS)[1],), "k = 1: stock's mask is the padding"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_no_items_and_int32_ids(dtype):
    assert count_items([], 3, TABLE_ROWS) == ItemCounts((), (), ())
    counts = count_items([grid_ids(3, 6, 27).to(dtype)], 3, TABLE_ROWS)
    assert counts == ItemCounts((18,), (2,), (False,))
