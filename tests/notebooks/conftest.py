import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # tiny_families
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
