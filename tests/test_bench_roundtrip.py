"""`tokenlake bench roundtrip` runs and reports what it says: per-layer round trip,
attention alone, their difference and a bare PING, per row count, from a real pool."""

from __future__ import annotations

import os

from tokenlake.dataplane.shm_files import list_buffers
from tokenlake.tools.bench.roundtrip import bench_roundtrip

#: the buffers of the pools this process starts (another test process's come and go)
MINE = f"tokenlake-{os.getpid()}-"


def test_the_roundtrip_benchmark_reports_every_figure_per_row_count():
    before = set(list_buffers(MINE, fifos=True))
    result = bench_roundtrip(repeats=1)
    keys = ("roundtrip_us", "attention_us", "overhead_us", "socket_roundtrip_us", "heads_up_roundtrip_us", "ping_us")
    for key in keys:
        assert set(result[key]) == {"1", "8"}, key
        for stats in result[key].values():
            assert stats["min"] <= stats["median"] <= stats["max"], (key, stats)
    for rows in ("1", "8"):
        assert result["attention_us"][rows]["median"] > 0 and result["ping_us"][rows]["median"] > 0
        # the pool's answer includes the same attention, run by the query engine
        assert result["roundtrip_us"][rows]["median"] > result["attention_us"][rows]["min"]
    assert result["isa"] and result["layers"] == 30
    assert result["path"] == "bell", "a pool on one host hands off through shared memory"
    fifo = result["fifo_pingpong_us"]
    assert fifo["sleeping"] > 0 and fifo["spinning"] > 0
    assert set(list_buffers(MINE, fifos=True)) == before, "the benchmark's pool left shared memory behind"
