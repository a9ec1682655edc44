"""The README's example runs and is exact (examples/quickstart.py)."""

import importlib.util
from pathlib import Path


def test_quickstart_example_matches_plain_attention():
    path = Path(__file__).parent.parent / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() < 1e-5
