"""gather_rows: the embedding lookup, from a table on the device or in pinned host memory."""

import pytest
import torch
import torch.nn.functional as F

from unsloth_kernels.embedding import gather_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n_cols", [1, 96, 4100], ids=lambda n: f"cols{n}")  # 4100: two column blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gather_rows_is_the_lookup(n_cols, dtype):
    table = torch.randn(37, n_cols).to(dtype)
    ids = torch.tensor([[0, 36, 5], [5, 17, 2]])
    if DEVICE == "cuda":
        table = table.pin_memory()  # read by the GPU from host memory
    out = gather_rows(table, ids.to(DEVICE))
    assert out.device.type == DEVICE and out.shape == (2, 3, n_cols) and out.dtype == dtype
    assert torch.equal(out.cpu(), F.embedding(ids, table))  # a copy: bit for bit


def test_gather_rows_of_no_ids():
    out = gather_rows(torch.randn(4, 8), torch.empty(0, 3, dtype=torch.long))
    assert out.shape == (0, 3, 8)


def test_gather_rows_refuses_bad_tables():
    with pytest.raises(ValueError, match="unit column stride"):
        gather_rows(torch.randn(8, 4).t(), torch.tensor([1]))
    with pytest.raises(ValueError, match="2-D"):
        gather_rows(torch.randn(8), torch.tensor([1]))
