"""The engines a LocalCluster starts sleep their idle OpenMP workers (``OPENMP_ENV``), as
under the ``tokenlake`` command, also when a Python program that set nothing starts
them; a setting of the caller's wins, and the caller's environment is left alone.

Run in a fresh interpreter: the forkserver keeps the environment of its first start for
the life of the process that started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tokenlake.engines.openmp import OPENMP_ENV

SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from dataplane_util import TINY
    from tokenlake.deploy.local import LocalCluster

    def environ(pid):
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
        return dict(x.decode().split("=", 1) for x in raw if b"=" in x)

    if __name__ == "__main__":
        before = dict(os.environ)
        with LocalCluster(1, TINY, 1 << 20, segment_tokens=8, max_rows=16) as cl:
            engines = {role: environ(cl._procs[(role, 0)].pid) for role in ("query", "transfer")}
        names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        print(json.dumps({"unchanged": dict(os.environ) == before,
                          "engines": {r: {n: e.get(n) for n in names} for r, e in engines.items()}}))
""")


def _run(env: dict[str, str]) -> dict:
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", SCRIPT, tests], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engines_sleep_idle_openmp_workers_unless_the_caller_set_otherwise():
    bare = {k: v for k, v in os.environ.items() if k not in OPENMP_ENV}
    got = _run(bare)
    assert got["unchanged"]  # the caller's environment is as it was
    assert got["engines"] == {role: OPENMP_ENV for role in ("query", "transfer")}
    mine = _run({**bare, "OMP_WAIT_POLICY": "ACTIVE"})
    assert mine["unchanged"]
    assert mine["engines"]["query"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000"}
