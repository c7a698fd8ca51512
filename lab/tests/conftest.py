"""The lab tooling's tests: the ones that run a tool end to end (several seconds of compilation
each) carry the ``slow`` marker and run with JAX_FLASH_SLOW=1 (``make test-all``)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("JAX_FLASH_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow; run with JAX_FLASH_SLOW=1 (a fast subset runs by default)")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)
