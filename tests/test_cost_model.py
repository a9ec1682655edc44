"""Tests of tokenlake.core.specs, tokenlake.core.cost_model and tokenlake.tools.profiler (all fast, CPU)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from importlib import resources

import pytest

from tokenlake.core.cost_model import (
    LatencyModel,
    LatencySample,
    LoadRequest,
    comm_bytes_per_query_layer,
    comm_overhead_s,
    compute_s_per_prefix_token,
    default_segment_tokens,
    get_cache_load,
    roofline_samples,
    segment_threshold,
)
from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import (
    HardwareProfile,
    ModelSpec,
    list_hardware,
    list_models,
    load_hardware,
    load_model,
)
from tokenlake.tools.profiler import profile_cpu, write_profile


@pytest.fixture(scope="module")
def llama() -> ModelSpec:
    return load_model("llama-2-7b")


@pytest.fixture(scope="module")
def a100() -> HardwareProfile:
    return load_hardware("a100-80gb")


def _hw(**overrides: float) -> HardwareProfile:
    fields = dict(name="test", flops=1e12, mem_bw=1e11, net_bw=1e10, net_latency_s=1e-5,
                  mem_bytes=1e10)
    fields.update(overrides)
    return HardwareProfile(**fields)


# --------------------------------------------------------------------------- specs


def test_llama_derived_sizes_match_paper_4d(llama: ModelSpec) -> None:
    d = llama.hidden_size
    assert llama.kv_bytes_per_token_layer == 4 * d
    assert llama.attn_flops_per_query_prefix_token_layer == 4 * d
    assert comm_bytes_per_query_layer(llama) == 4 * d
    assert llama.kv_bytes_per_token == 32 * 4 * d
    assert llama.segment_bytes(512) == 32 * 2 * 32 * 512 * 128 * 2
    assert llama.partial_bytes_per_token_layer == 32 * 128 * 4 + 32 * 4


def test_gqa_sizes() -> None:
    small = load_model("smollm2-135m")
    assert small.kv_bytes_per_token_layer == 2 * 3 * 64 * 4
    assert small.q_bytes_per_token_layer == 9 * 64 * 4


@pytest.mark.parametrize(
    "change",
    [{"num_layers": 0}, {"num_kv_heads": 5}, {"head_dim": -1}, {"dtype_bytes": 0},
     {"num_params": float("nan")}, {"name": ""}, {"head_dim": 64.0}],
)
def test_bad_model_spec_raises(llama: ModelSpec, change: dict) -> None:
    with pytest.raises(ConfigError):
        ModelSpec.from_dict({**llama.to_dict(), **change})


@pytest.mark.parametrize("change", [{"flops": 0}, {"mem_bw": -1.0}, {"net_latency_s": 0}])
def test_bad_hardware_raises(change: dict) -> None:
    with pytest.raises(ConfigError):
        _hw(**change)


def test_from_dict_rejects_unknown_and_missing_keys(llama: ModelSpec) -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        ModelSpec.from_dict({**llama.to_dict(), "rope_theta": 1e4})
    data = llama.to_dict()
    del data["head_dim"]
    with pytest.raises(ConfigError, match="head_dim"):
        ModelSpec.from_dict(data)
    assert ModelSpec.from_dict(llama.to_dict()) == llama


def test_unknown_names_list_valid_ones() -> None:
    with pytest.raises(ConfigError, match="llama-2-7b"):
        load_model("gpt-5")
    with pytest.raises(ConfigError, match="a100-80gb"):
        load_hardware("tpu")
    with pytest.raises(ConfigError, match="a100-80gb_llama-2-7b"):
        LatencyModel.load("nope")


def test_all_shipped_json_loads() -> None:
    assert {"llama-2-7b", "lwm-text-1m", "smollm2-135m"} <= set(list_models())
    assert {"a100-80gb", "h100-80gb", "h200", "cpu"} <= set(list_hardware())
    for name in list_models():
        load_model(name)
    for name in list_hardware():
        assert load_hardware(name).notes
    latency = LatencyModel.load("a100-80gb_llama-2-7b")
    assert latency.predict([(1, 1000)]) > 0
    assert load_model("lwm-text-1m").max_context == 1 << 20


# --------------------------------------------------------------------------- threshold


def test_threshold_reproduces_paper(llama: ModelSpec, a100: HardwareProfile) -> None:
    assert 560 <= segment_threshold(llama, a100) <= 575
    assert comm_overhead_s(llama, a100) * 1e6 == pytest.approx(4.66, abs=0.05)
    assert compute_s_per_prefix_token(llama, a100) == pytest.approx(4 * 4096 / 2.0e12)


def test_default_segment_tokens_rounds_up(llama: ModelSpec, a100: HardwareProfile) -> None:
    assert default_segment_tokens(llama, a100) == 576
    assert default_segment_tokens(llama, a100, multiple=1) == 569
    assert default_segment_tokens(llama, a100, multiple=1000) == 1000
    fast_net = _hw(net_latency_s=1e-15, net_bw=1e18)  # threshold far below one token
    assert default_segment_tokens(llama, fast_net, multiple=16) == 16
    with pytest.raises(ConfigError):
        default_segment_tokens(llama, a100, multiple=0)


# --------------------------------------------------------------------------- latency


def _random_batches(n: int, seed: int = 1) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = tuple((rng.randint(1, 2000), rng.randint(0, 8000))
                      for _ in range(rng.randint(1, 6)))
        out.append((batch, rng.choice([1, 2, 4])))
    return out


def test_fit_recovers_known_coefficients() -> None:
    truth = LatencyModel(c_const=3e-3, c_new=2e-5, c_new_prefix=1.5e-9, c_new_sq=4e-9,
                         c_prefix=2.5e-7, c_request=1e-4)
    samples = [LatencySample(b, k, truth.predict(b, k)) for b, k in _random_batches(200)]
    fitted = LatencyModel.fit(samples)
    for got, want in zip(fitted.coefficients, truth.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_predict_monotone_in_new_tokens() -> None:
    model = LatencyModel.load("a100-80gb_llama-2-7b")
    times = [model.predict([(n, 4096), (8, 100)]) for n in (1, 16, 256, 4096)]
    assert times == sorted(times) and times[0] < times[-1]


def test_k_divides_only_proportional_terms() -> None:
    model = LatencyModel(c_const=1.0, c_new=2.0, c_new_prefix=3.0, c_new_sq=4.0,
                         c_prefix=5.0, c_request=6.0)
    batch = [(2, 3), (1, 0)]
    # new=3, new*prefix=6, new^2=5, prefix=3, n=2
    proportional = 2.0 * 3 + 3.0 * 6 + 4.0 * 5 + 5.0 * 3
    assert model.predict(batch, k=1) == pytest.approx(1.0 + 6.0 * 2 + proportional)
    assert model.predict(batch, k=4) == pytest.approx(1.0 + 6.0 * 2 + proportional / 4)
    with pytest.raises(ConfigError):
        model.predict(batch, k=0)
    # A measured speed-up replaces k (the last value for larger k).
    slow = LatencyModel(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, dop_speedup=(1.0, 1.25))
    assert slow.predict(batch, k=2) == pytest.approx(1.0 + 6.0 * 2 + proportional / 1.25)
    assert slow.predict(batch, k=4) == slow.predict(batch, k=2)
    assert slow.speedup(1) == 1.0 and model.speedup(3) == 3.0
    for bad in ((1.25,), (1.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ConfigError, match="dop_speedup"):
            LatencyModel(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, dop_speedup=bad)
    assert LatencyModel.from_dict(slow.to_dict(), slow.dop_speedup) == slow


def test_latency_model_validation_and_round_trip() -> None:
    model = LatencyModel.load("a100-80gb_llama-2-7b")
    assert LatencyModel.from_dict(model.to_dict()) == model
    with pytest.raises(ConfigError):
        LatencyModel(-1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ConfigError):
        LatencyModel.from_dict({"c_const": 1.0})
    with pytest.raises(ConfigError):
        LatencyModel.fit([])


def test_roofline_samples_reproducible_and_fit_reasonable(llama, a100) -> None:
    a = roofline_samples(llama, a100, n_samples=60, seed=3)
    assert a == roofline_samples(llama, a100, n_samples=60, seed=3)
    assert all(s.seconds > 1e-3 for s in a)
    path = resources.files("tokenlake").joinpath("data", "latency", "a100-80gb_llama-2-7b.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["fit"]["mean_rel_err"] < 0.15


# --------------------------------------------------------------------------- cache load


def test_cache_load_hand_computed(llama: ModelSpec) -> None:
    hw = _hw(flops=1e12, mem_bw=1e11)
    latency = LatencyModel(c_const=0.01, c_new=1e-4, c_new_prefix=0.0, c_new_sq=0.0,
                           c_prefix=0.0, c_request=0.0)
    reqs = [LoadRequest(input_len=100, prefix_len=1000), LoadRequest(input_len=1, prefix_len=3000)]
    per_token = 32 * 2 * 32 * 128 * 2  # bytes of K and V over all layers
    mem = per_token * (1100 + 3001)
    flops = 32 * 4 * 32 * 128 * (1000 * 100 + 3000 * 1)
    t = 0.01 + 1e-4 * 101 / 2  # two instances share the token term
    want = max(mem / (mem + 2 * 1e11 * t), flops / (flops + 2 * 1e12 * t))
    assert get_cache_load(reqs, 2, llama, hw, latency) == pytest.approx(want, rel=1e-12)


def test_cache_load_range_and_growth(llama: ModelSpec, a100: HardwareProfile) -> None:
    latency = LatencyModel.load("a100-80gb_llama-2-7b")
    assert get_cache_load([], 8, llama, a100, latency) == 0.0
    loads = [get_cache_load([LoadRequest(input_len=1, prefix_len=p)] * 32, 8, llama, a100,
                            latency) for p in (0, 1000, 8000, 32000)]
    assert all(0.0 <= x < 1.0 for x in loads)
    assert loads == sorted(loads) and loads[0] < loads[-1]
    prefill = [get_cache_load([LoadRequest(input_len=2048, prefix_len=p)], 8, llama, a100,
                              latency) for p in (0, 4000, 24000)]
    assert prefill == sorted(prefill) and all(0.0 <= x < 1.0 for x in prefill)


# --------------------------------------------------------------------------- profiler


def test_profiler_tiny_memcpy(tmp_path) -> None:
    prof = profile_cpu(mem_mib=1, matmul_n=32, transfer_mib=1, repeats=1, transfer="memcpy")
    assert prof.flops > 0 and prof.mem_bw > 0 and prof.net_bw > 0 and prof.mem_bytes > 0
    table = tmp_path / "hw.json"
    table.write_text(json.dumps({"other": load_hardware("a100-80gb").to_dict()}))
    write_profile(prof, str(table), merge=True)
    assert set(json.loads(table.read_text())) == {"other", "cpu"}


def test_profiler_tiny_zmq() -> None:
    pytest.importorskip("zmq")
    prof = profile_cpu(mem_mib=1, matmul_n=32, transfer_mib=1, repeats=1, transfer="zmq")
    assert 0 < prof.net_latency_s < 0.1 and prof.net_bw > 0


def test_core_imports_without_numpy_torch_zmq() -> None:
    code = (
        "import sys\n"
        "for m in ('numpy', 'scipy', 'torch', 'zmq'): sys.modules[m] = None\n"
        "import tokenlake.core.specs, tokenlake.core.cost_model, tokenlake.tools.profiler\n"
        "from tokenlake.core.cost_model import segment_threshold\n"
        "from tokenlake.core.specs import load_model, load_hardware\n"
        "print(segment_threshold(load_model('llama-2-7b'), load_hardware('a100-80gb')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert 560 <= float(out.stdout) <= 575
