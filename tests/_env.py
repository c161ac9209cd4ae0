"""Where the tests run: ON_GPU, DEVICE ("cuda", or "cpu" through Triton's interpreter) and SCALE ("gpu": realistic
shapes; "cpu": small ones). Test modules import these names from here (`from _env import DEVICE`), the one way;
importing sets TRITON_INTERPRET on a CPU machine before any generated module is imported."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when generated modules are imported

DEVICE = "cuda" if ON_GPU else "cpu"

# Triton 3.6's interpreter fails with numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars");
# pyproject pins numpy below that, but a GPU image may ship a newer one (the H100's has 2.5). Tests that force the
# interpreter in a GPU process (doc blocks in their CPU form) skip there; the kernels themselves run compiled.
INTERPRETER_WORKS = tuple(int(x) for x in __import__("numpy").__version__.split(".")[:2]) < (2, 4)
SCALE = "gpu" if ON_GPU else "cpu"
