"""The control plane is pure Python: importing it pulls in no torch, zmq, numpy or scipy
(docs/design.md §2)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Every module of the pure core, found on disk (a new core module is checked without
#: anyone adding it to a list), plus the command line, whose help must stay light.
CORE = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "tokenlake" / "core").rglob("*.py")
)
CONTROL_PLANE = ["tokenlake", *CORE, "tokenlake.tools.walkthrough", "tokenlake.tools.cli"]
HEAVY = ["torch", "zmq", "numpy", "scipy", "msgpack"]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_importing_the_control_plane_loads_no_heavy_module():
    code = (
        "import importlib, sys\n"
        f"for m in {CONTROL_PLANE!r}: importlib.import_module(m)\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_control_plane_plans_with_torch_and_zmq_blocked():
    """With torch and zmq made unimportable, a whole prefill + decode cycle still plans."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['zmq'] = None\n"
        "from tokenlake.core.config import PoolConfig\n"
        "from tokenlake.core.control import ControlPlane\n"
        "from tokenlake.core.plans import Batch, BatchRequest\n"
        "from tokenlake.core.specs import load_model\n"
        "cp = ControlPlane(PoolConfig(4, 'ns', 8), load_model('smollm2-135m'), [0, 1])\n"
        "p = cp.gen_plans([Batch((BatchRequest('a', tuple(range(1, 11))),))], [1])\n"
        "cp.complete(p)\n"
        "p = cp.gen_plans([Batch((BatchRequest('a', (5,)),), 'decode')], [1])\n"
        "print(p.query_plans[0].spans[0].prefix_tokens)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10"


def test_the_core_list_is_found():
    assert "tokenlake.core.control" in CORE and "tokenlake.core" in CORE
    assert len(CORE) >= 14
