"""``kill -9`` of the process that owns a LocalCluster (issue #17, finding 1): within 5 s
no engine of its cluster runs and its shared memory is gone; a new cluster sweeps
buffers whose creator is dead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tokenlake.dataplane.shm_files import (
    cluster_prefix,
    create_buffer,
    list_buffers,
    pid_alive,
    unlink_buffer,
)

OWNER = textwrap.dedent("""
    import json, sys, threading
    from tokenlake.core.specs import load_model
    from tokenlake.deploy.local import LocalCluster

    if __name__ == "__main__":
        cluster = LocalCluster(2, load_model("smollm2-135m"), 4 << 20, segment_tokens=16,
                               max_rows=32)
        cluster.start()
        print(json.dumps({"cluster_id": cluster.cluster_id,
                          "pids": [p.pid for p in cluster._procs.values()]}), flush=True)
        threading.Event().wait()  # until killed
""")


def test_engines_and_buffers_go_within_5_s_of_the_owners_kill_9(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(owner.stdout.readline())
        prefix = cluster_prefix(started["cluster_id"])
        assert len(list_buffers(prefix)) > 0 and all(map(pid_alive, started["pids"]))
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)  # reaped, as its parent (a shell, a service manager) would
        killed = time.monotonic()
        while any(map(pid_alive, started["pids"])) or list_buffers(prefix):
            assert time.monotonic() - killed < 5.0, (
                [p for p in started["pids"] if pid_alive(p)], list_buffers(prefix))
            time.sleep(0.05)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()


def test_a_new_cluster_sweeps_buffers_of_dead_owners():
    from tokenlake.core.specs import load_model
    from tokenlake.deploy.local import LocalCluster

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    assert not pid_alive(dead.pid)
    name = create_buffer(f"tokenlake-{dead.pid}-feedbeef-slab-0", 16).name
    assert name in list_buffers()
    mine = create_buffer(f"tokenlake-{os.getpid()}-feedbeef-slab-0", 16).name
    try:
        with LocalCluster(1, load_model("smollm2-135m"), 4 << 20, segment_tokens=16,
                          max_rows=32):
            assert name not in list_buffers(), "the dead owner's buffer was swept"
            assert mine in list_buffers(), "a live owner's buffer stays"
    finally:
        for n in (name, mine):
            unlink_buffer(n)
