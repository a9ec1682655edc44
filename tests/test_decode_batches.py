"""``tokenlake eval decode-batches`` (evals/decode_batches.py): what a run reports from
its token times, and the command's arguments. The real-engine runs themselves take
minutes (docs/evaluation.md has their figures); kept against re-formed decode batches on
real engines is tested in tests/test_serving.py."""

from __future__ import annotations

import pytest

from evals.decode_batches import _summary
from tokenlake.tools import cli


def test_a_runs_summary_counts_every_gap_over_the_slo():
    """Two requests: one steady (gaps 0.1 s), one with a 0.5 s stall among 0.1 s gaps.
    With a 0.2 s SLO the stall is the one miss; by its mean gap (0.233 s) the second
    request misses, the first meets it; a request of one token has no gap."""
    run = {"stamps": {"a": [0.0, 0.1, 0.2, 0.3], "b": [1.0, 1.1, 1.6, 1.7], "c": [2.0]},
           "decode_moves": 3, "iterations": 9, "wall_s": 2.0}
    got = _summary(run, 0.2)
    assert got["tbt_gaps"] == 6 and got["tbt_misses"] == 1
    assert got["tbt_miss_share"] == pytest.approx(1 / 6)
    assert got["requests_within_slo"] == pytest.approx(0.5)
    assert got["mean_tbt_s"] == pytest.approx(1.0 / 6)
    assert got["decode_moves"] == 3


def test_the_command_runs_at_one_rate(capsys):
    try:
        code = cli.main(["eval", "decode-batches", "--rates", "2", "4"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert "one rate" in capsys.readouterr().err
