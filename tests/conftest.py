"""Session-wide hygiene: no test may leave engine processes or shared memory behind."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/dataplane_util.py


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    from tokenlake.shm import list_segments

    before = set(list_segments())
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith("tokenlake-")]
    leaked = sorted(set(list_segments()) - before)
    assert not children, f"engine processes still running after the tests: {children}"
    assert not leaked, f"shared memory left behind: {leaked}"
