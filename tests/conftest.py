"""Test set-up: the CPU runs kernels through Triton's interpreter; a GPU runs them compiled at realistic shapes.

The kernel cache of a test run lives under pytest's own temporary folder (tmp_path_factory), which pytest prunes:
runs leave nothing behind in /tmp.
"""

import os

from hypothesis import HealthCheck, settings

from _env import ON_GPU  # sets TRITON_INTERPRET on a CPU machine; test modules import DEVICE/SCALE from _env too

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=False, print_blob=True)
settings.register_profile("ci", max_examples=10, **_common)
settings.register_profile("gpu", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if ON_GPU else "ci"))


def pytest_configure(config):
    # One cache per worker, inside pytest's temporary folder (kept for the last three runs, then removed).
    if "FAGEN_CACHE_DIR" not in os.environ or os.environ.get("FAGEN_TEST_OWN_CACHE") == "1":
        from _pytest.tmpdir import TempPathFactory

        factory = TempPathFactory.from_config(config, _ispytest=True)
        os.environ["FAGEN_CACHE_DIR"] = str(factory.mktemp("fagen-cache"))
        os.environ["FAGEN_TEST_OWN_CACHE"] = "1"

