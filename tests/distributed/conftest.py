import os
import sys
from pathlib import Path

import torch

# The patches run our Triton kernels; without a GPU they need Triton's CPU interpreter, chosen before
# the kernels are imported. The workers started by torchrun inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # tiny_setup
