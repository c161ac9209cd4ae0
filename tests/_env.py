"""Where the tests run: ON_GPU, DEVICE ("cuda", or "cpu" through Triton's interpreter) and SCALE ("gpu": realistic
shapes; "cpu": small ones). Test modules import these names from here (`from _env import DEVICE`), the one way;
importing sets TRITON_INTERPRET on a CPU machine before any generated module is imported."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when generated modules are imported

DEVICE = "cuda" if ON_GPU else "cpu"
SCALE = "gpu" if ON_GPU else "cpu"
