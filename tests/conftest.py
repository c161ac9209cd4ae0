"""Test set-up: the CPU runs kernels through Triton's interpreter; a GPU runs them compiled at realistic shapes."""

import os
import tempfile

import torch
from hypothesis import HealthCheck, settings

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when generated modules are imported
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp(prefix="fagen-test-cache-"))

DEVICE = "cuda" if ON_GPU else "cpu"
SCALE = "gpu" if ON_GPU else "cpu"

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=False, print_blob=True)
settings.register_profile("ci", max_examples=10, **_common)
settings.register_profile("gpu", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if ON_GPU else "ci"))
