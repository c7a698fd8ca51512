import os

import jax
import numpy as np
import pytest

SLOW = os.environ.get("JAX_FLASH_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on the H200)")
    skip_slow = pytest.mark.skip(reason="slow; run with JAX_FLASH_SLOW=1 (a fast subset runs by default)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not SLOW:
            item.add_marker(skip_slow)


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed (shown on failure), and
    JAX_FLASH_SEED=<seed> replays it."""
    seed = int(os.environ.get("JAX_FLASH_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"JAX_FLASH_SEED={seed}")
    return np.random.default_rng(seed)
