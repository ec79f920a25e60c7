import os

import pytest
import torch

# The patches run our Triton kernels; without a GPU they need Triton's CPU interpreter, which must
# be chosen before the kernels are imported (scripts/test sets it for the whole run).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)
