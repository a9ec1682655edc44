"""The measurements behind the CPU latency model's DoP speed-up and query-engine costs
(``tokenlake profile-latency --dop-speedup`` / ``--query-engine``), run small."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tokenlake.core.cost_model import LatencyModel
from tokenlake.kernels import native
from tokenlake.tools import cli
from tokenlake.tools.latency_profile import measure_dop_speedup, measure_query_engine


def test_dop_speedup_is_measured_for_every_dop_and_starts_at_one():
    got = measure_dop_speedup(instances=2, rows=(32,), prefix=128, segment_tokens=64, repeats=1)
    sp = got["dop_speedup"]
    assert len(sp) == 2 and sp[0] == 1.0 and sp[1] > 0
    secs = got["dop_setup"]["seconds"]
    assert set(secs) == {"32x1", "32x2"} and sp[1] == pytest.approx(secs["32x1"] / secs["32x2"])
    assert LatencyModel(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, dop_speedup=sp).speedup(2) == sp[1]


def test_query_engine_costs_are_fitted_from_the_engines_busy_time():
    coefficients = LatencyModel.load("cpu_smollm2-135m").to_dict()
    got = measure_query_engine(coefficients, instances=2, prefix=128, segment_tokens=64, repeats=1)["query_engine"]
    assert got["message_s"] > 0 and got["work_scale"] >= 0 and math.isfinite(got["residual"])
    model = LatencyModel.from_dict(coefficients, (), got["message_s"], got["work_scale"])
    assert model.query_message_s == got["message_s"]


def test_adding_a_measurement_needs_an_existing_profile(tmp_path, capsys):
    missing = tmp_path / "none.json"
    with pytest.raises(SystemExit, match="existing profile"):
        cli.main(["profile-latency", "--out", str(missing), "--dop-speedup"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):
        cli.main(["profile-latency", "--out", str(bad), "--query-engine"])


def test_a_small_profile_measures_every_sampled_batch_and_fits_the_model():
    from tokenlake.tools.latency_profile import profile

    doc = profile(n_samples=6, instances=2, max_prefix=128, segment_tokens=64, repeats=1)
    assert len(doc["samples"]) == 6 and all(s["seconds"] > 0 for s in doc["samples"])
    assert doc["setup"]["segment_tokens"] == 64 and doc["setup"]["max_prefix"] == 128
    LatencyModel.from_dict(doc["coefficients"])  # a valid model
    assert doc["fit"]["n_samples"] == 6
    assert doc["machine"] == native.machine_info()  # what the figures hold for
    assert doc["setup"]["share_slabs"] is False  # each query engine on its own slab, as simulated


def test_machines_are_the_same_only_when_cpu_cores_and_isa_agree():
    here = native.machine_info()
    assert set(here) == {"cpu", "cores", "isa", "bf16_dots", "bf16_products"} and here["cores"] >= 1
    assert native.same_machine(here, dict(here))
    assert not native.same_machine(here, {**here, "cores": here["cores"] + 1})
    assert not native.same_machine(here, {**here, "isa": "base" if here["isa"] != "base" else "avx2"})
    assert not native.same_machine(None, here) and not native.same_machine(here, None)
    # bfloat16 products change what a decode costs; a record without the key had none
    assert not native.same_machine(here, {**here, "bf16_products": 1 + here["bf16_products"]})
    assert native.same_machine({k: here[k] for k in ("cpu", "cores", "isa")}, {**here, "bf16_products": 0})
    shipped = json.loads((Path(__file__).parents[1] / "tokenlake/data/latency/cpu_smollm2-135m.json").read_text())
    assert set(shipped["machine"]) == {"cpu", "cores", "isa"}  # the shipped model says where it was measured
