import os

import torch

# The patches run our Triton kernels; without a GPU they need Triton's CPU interpreter, which must
# be chosen before the kernels are imported (scripts/test sets it for the whole run).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
