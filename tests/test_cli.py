"""The ``tokenlake`` command line: one tree, ``--version``, defaults in every help, and
every user mistake ending in one line on stderr with exit code 2 (no traceback).

Most cases run in-process through :func:`tokenlake.tools.cli.main`; the three mistakes
the issue names also run as real subprocesses, as a user would meet them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from importlib import metadata, resources

import pytest

from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import list_hardware, list_models
from tokenlake.tools import cli
from tokenlake.tools.cli import eval as cli_eval
from tokenlake.tools.cli.args import UsageError


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``tokenlake ARGV`` run in this process."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: --help, --version and parse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenlake: error: "), err


def leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(path, parser)`` of every command of the tree that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from leaf_commands(child, (*path, name))


LEAVES = dict(leaf_commands(cli.build_parser()))


# --------------------------------------------------------------------------- version, help


def test_version_is_the_installed_package_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"tokenlake {metadata.version('tokenlake')}"


def test_the_command_line_sets_its_openmp_defaults_and_keeps_the_users(monkeypatch, capsys):
    """``tokenlake`` gives itself (and the engines it starts) passive OpenMP waits with a
    short spin unless the user set them; a vLLM server it starts gets neither of ours."""
    from tokenlake.engines.openmp import OPENMP_ENV
    from tokenlake.tools.bench.vllm import vllm_env

    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # recorded, so teardown undoes what main sets
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")
    run(["--version"], capsys)
    assert os.environ["OMP_WAIT_POLICY"] == OPENMP_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == "77"
    env = vllm_env({**os.environ, "PATH": "/bin"})
    assert "OMP_WAIT_POLICY" not in env and env["GOMP_SPINCOUNT"] == "77" and env["PATH"] == "/bin"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    run(["--version"], capsys)
    assert os.environ["GOMP_SPINCOUNT"] == OPENMP_ENV["GOMP_SPINCOUNT"]
    assert "GOMP_SPINCOUNT" not in vllm_env(os.environ)


def test_the_tree_has_every_command():
    assert set(LEAVES) == {
        ("demo",), ("walkthrough",), ("serve",), ("threshold",), ("fit-roofline",),
        ("profile-cpu",), ("profile-latency",), ("eval",), ("sim",), ("config", "show"),
        ("status",),
        *(("bench", b) for b in ("plans", "query-vs-fetch", "kernel", "gpu", "curve", "vllm", "e2e", "scheduler", "sim", "restart", "roundtrip",
                                         "serve", "http", "soak")),
    }


@pytest.mark.parametrize("path", sorted(LEAVES), ids=" ".join)
def test_every_help_works_and_shows_its_defaults(path, capsys):
    code, out, err = run([*path, "--help"], capsys)
    assert code == 0 and not err
    assert out.startswith(f"usage: tokenlake {' '.join(path)}")
    for action in LEAVES[path]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.dest} of {path} has no help"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in " ".join(out.split()), action.dest


def test_help_of_a_group_lists_its_commands(capsys):
    code, out, _ = run(["bench", "--help"], capsys)
    assert code == 0
    for name in ("plans", "query-vs-fetch", "curve", "vllm", "e2e", "scheduler", "sim", "serve", "http",
                                         "soak"):
        assert name in out


def test_building_the_tree_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from tokenlake.tools.cli import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = ('torch', 'numpy', 'scipy', 'zmq', 'msgpack', 'ray', 'evals', 'tqdm')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize("argv", [
    "threshold --model unknown",
    "demo --instances 0",
    "serve --ray auto --ports abc",
])
def test_the_named_mistakes_end_in_one_line_and_exit_2(argv):
    out = subprocess.run([sys.executable, "-m", "tokenlake.tools.cli", *argv.split()],
                         capture_output=True, text=True, timeout=60)
    assert_one_line_error(out.returncode, out.stderr)
    assert out.stdout == ""


@pytest.mark.parametrize("argv", [
    [],
    ["no-such-command"],
    ["bench"],
    ["bench", "plans", "--instances", "0"],
    ["bench", "e2e", "--instances", "four"],
    ["bench", "scheduler", "--prefill-share", "1.5"],
    ["bench", "sim", "--rate", "1", "--speedup", "2"],
    ["threshold", "--hardware", "tpu"],
    ["walkthrough", "--requests", "-1"],
    ["serve", "--control-port", "70000"],
    ["serve", "--ray", "auto", "--ports", "9000-8000"],
    ["serve", "--ray", "auto", "--engine-share", "0"],
    ["serve", "--ray", "auto", "--model", "gpt-5"],
    ["fit-roofline", "--hardware", "a100-80gb", "--model", "llama-2-7b"],
    ["fit-roofline", "--hardware", "a100-80gb", "--model", "llama-2-7b", "--samples", "3",
     "--out", "x.json"],
    ["eval", "figure-99"],
    ["eval", "e2e", "--systems", "vllm"],
    ["eval", "e2e", "--jobs", "0"],
    ["sim", "--trace", "t.jsonl", "--system", "vllm"],
])
def test_parse_mistakes_end_in_one_line_and_exit_2(argv, capsys):
    assert_one_line_error(*run(argv, capsys)[::2])


def test_a_missing_output_folder_is_refused_before_any_work(tmp_path, capsys):
    code, _, err = run(["profile-cpu", "--out", str(tmp_path / "nowhere" / "hw.json")], capsys)
    assert_one_line_error(code, err)
    assert "does not exist" in err
    code, _, err = run(["profile-latency", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err)
    assert "is a folder" in err


def test_a_bad_port_range_from_the_environment_is_a_mistake_too(monkeypatch, capsys):
    monkeypatch.setenv("TOKENLAKE_PORTS", "abc")
    assert_one_line_error(*run(["serve", "--ray", "auto"], capsys)[::2])


@pytest.mark.parametrize("argv,needle", [
    (["eval", "e2e", "--workload", "mixed"], "valid: loogle, scbench, sharegpt"),
    (["eval", "hit-rate", "--workload", "loogle", "scbench"], "one workload"),
    (["eval", "load-balance", "--rates", "1", "2"], "one rate"),
    (["sim", "--trace", "missing.jsonl"], "not found"),
    (["eval", "hit-rate", "--trace", "missing.jsonl"], "not found"),
    (["eval", "e2e", "--trace", "missing.jsonl"], "not found"),
    (["eval", "load-balance", "--trace", "missing.jsonl"], "for hit-rate and e2e"),
    (["eval", "e2e", "--trace", "missing.jsonl", "--workload", "loogle"], "not both"),
    (["eval", "hit-rate", "--workload", "scbench", "--zipf", "1"], "has none"),
    (["eval", "hit-rate", "--zipf", "-1"], "> 0"),
    (["bench", "sim", "--trace", "missing.jsonl"], "not found"),
    (["serve", "--device", "gpu"], "'cpu', 'cuda' or 'cuda:N'"),
    (["serve", "--device", "cuda", "--ray", "auto"], "serves without --ray only"),
    (["serve", "--device", "cuda", "--kv-layout", "hf"], "serves --kv-layout tokenlake only"),
    (["demo", "--device", "cuda"], "needs --kv-dtype bfloat16 or float16"),
    (["bench", "e2e", "--device", "cuda"], "needs --kv-dtype bfloat16 or float16"),
    (["bench", "e2e", "--device", "cuda", "--kv-dtype", "bfloat16", "--tier-only"], "no tier or vLLM rows"),
    (["bench", "e2e", "--device", "cuda", "--kv-dtype", "bfloat16", "--tier"], "no tier or vLLM rows"),
])
def test_mistakes_found_while_running_end_in_one_line_and_exit_2(argv, needle, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # "missing.jsonl" is missing here
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err)
    assert needle in err


def test_a_config_error_from_the_input_ends_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    code, _, err = run(["sim", "--trace", str(trace), "--cache-gb", "0.0001", "--json"], capsys)
    assert_one_line_error(code, err)
    assert "segment" in err


@pytest.mark.parametrize("exc", [UsageError("bad input\nsecond line"),
                                 ConfigError("bad input\nsecond line")])
def test_main_turns_usage_and_config_errors_into_one_line(exc, monkeypatch, capsys):
    def command(args):
        raise exc

    monkeypatch.setattr(cli_eval, "run_sim", command)  # the tree is built inside main
    code, _, err = run(["sim", "--trace", "t.jsonl"], capsys)
    assert_one_line_error(code, err)
    assert err == "tokenlake: error: bad input second line\n"


def test_a_bug_is_not_disguised_as_a_usage_error(monkeypatch):
    def command(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli_eval, "run_sim", command)
    with pytest.raises(KeyError):
        cli.main(["sim", "--trace", "t.jsonl"])


# --------------------------------------------------------------------------- valid names


def test_unknown_names_are_answered_with_the_valid_ones(capsys):
    _, _, err = run(["threshold", "--model", "unknown"], capsys)
    assert all(name in err for name in list_models())
    _, _, err = run(["sim", "--trace", "t", "--hardware", "unknown"], capsys)
    assert all(name in err for name in list_hardware())
    _, _, err = run(["eval", "unknown"], capsys)
    assert all(name in err for name in cli_eval.EXPERIMENT_NAMES)


def test_the_names_listed_for_the_simulator_are_its_registries():
    from evals import experiments
    from evals.sim.systems import SYSTEMS

    assert cli_eval.SYSTEM_NAMES == tuple(SYSTEMS)
    assert cli_eval.EXPERIMENT_NAMES == tuple(experiments.EXPERIMENTS)
    assert cli_eval.WORKLOAD_NAMES == tuple(experiments.DEFAULT_RATES)
    assert cli_eval.E2E_WORKLOADS == tuple(experiments.WORKLOADS)
    assert cli_eval.MAIN_SYSTEMS == tuple(experiments.MAIN_SYSTEMS)


# --------------------------------------------------------------------------- commands


def test_threshold_prints_the_papers_figure(capsys):
    code, out, _ = run(["threshold", "--hardware", "a100-80gb", "--model", "llama-2-7b"], capsys)
    assert code == 0
    assert json.loads(out)["default_segment_tokens"] == 576


def test_fit_roofline_writes_a_latency_model_and_the_command_that_made_it(tmp_path, capsys):
    from tokenlake.core.cost_model import LatencyModel

    out = tmp_path / "fit.json"
    argv = ["fit-roofline", "--hardware", "a100-80gb", "--model", "llama-2-7b", "--samples",
            "40", "--out", str(out)]
    code, printed, _ = run(argv, capsys)
    assert code == 0
    doc = json.loads(out.read_text())
    LatencyModel.from_dict(doc["coefficients"])
    assert {"mean_rel_err", "max_rel_err"} <= set(doc["fit"]) and json.loads(printed) == doc["fit"]
    assert doc["generated_by"] == "tokenlake " + shlex.join(argv)


def test_the_commands_named_in_the_shipped_data_parse():
    """Each "generated_by" / "Regenerate with:" string names a command of this tree."""
    data = resources.files("tokenlake").joinpath("data")
    commands = [json.loads(data.joinpath("latency", f).read_text())["generated_by"]
                for f in ("a100-80gb_llama-2-7b.json", "cpu_smollm2-135m.json")]
    hardware = json.loads(data.joinpath("hardware.json").read_text())
    commands += [e["notes"].split("Regenerate with: ")[1] for e in hardware.values()
                 if "Regenerate with: " in e["notes"]]
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "tokenlake"
        args = cli.build_parser().parse_args(words[1:])
        assert callable(args.run)


def test_demo_exits_1_when_an_answer_differs_from_the_reference(monkeypatch, capsys):
    """A wrong answer is not a usage mistake: exit 1 (the demo module is faked, no model)."""
    fake = type(sys)("tokenlake.tools.demo")
    fake.DemoConfig = lambda instances, kv_dtype, device: instances
    fake.print_report = lambda report: None
    fake.run_demo = lambda config, progress: {"reference_match": config == 3}
    monkeypatch.setitem(sys.modules, "tokenlake.tools.demo", fake)
    assert run(["demo", "--instances", "2", "--json"], capsys)[0] == 1
    assert run(["demo", "--instances", "3", "--json"], capsys)[0] == 0


def test_walkthrough_prints_both_runs_as_text_and_json(capsys):
    argv = ["walkthrough", "--requests", "6", "--instances", "2"]
    code, out, _ = run([*argv, "--json"], capsys)
    assert code == 0
    runs = json.loads(out)
    assert [r["replication"] for r in runs] == [False, True]
    assert all(r["requests"] == 6 and set(r["reads_per_instance"]) == {"0", "1"} for r in runs)
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert "[hash placement only]" in out and "[with heavy-hitter replication]" in out
    assert "6 LooGLE-like requests" in out


def test_bench_scheduler_takes_its_options_and_records_them(capsys):
    code, out, _ = run(["bench", "scheduler", "--instances", "2", "4", "--requests", "8",
                        "--repeats", "1", "--prefill-share", "0.5"], capsys)
    assert code == 0
    result = json.loads(out)
    assert set(result["decision_ms"]) == {"2", "4"}
    assert result["config"] == {"requests": 8, "prefill_share": 0.5, "prefill_dops": "all"}


def test_bench_gpu_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(["bench", "gpu", "--rows", "1", "--no-query-vs-fetch"], capsys)
    assert code == 2 and out == ""
    assert err.strip() == "tokenlake: error: bench gpu needs a CUDA GPU; this torch sees none"


def test_bench_sim_replays_a_given_trace(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 600,
                                           "output_length": 2, "hash_ids": [0, i + 1]})
                               for i in range(4)))
    code, out, _ = run(["bench", "sim", "--trace", str(trace), "--repeat", "2",
                        "--instances", "2"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["requests"] == 8 and result["repeat"] == 2 and result["trace"] == "t.jsonl"


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_experiment_whose_run_cannot_finish_ends_in_one_line_and_exit_1(tmp_path, capsys,
                                                                          jobs):
    """A request larger than a router worker's memory: the experiment names the run that
    failed, in one line, and exits 1 (not a usage mistake, not a traceback), also with
    runs in parallel processes."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 60000, "output_length": 2, '
                     '"hash_ids": ' + str(list(range(118))) + '}\n')
    code, _, err = run(["eval", "hit-rate", "--trace", str(trace), "--cache-gb", "5",
                        "--systems", "tokenlake", "sglang-router", "--jobs", jobs, "--quiet",
                        "--no-plots", "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("tokenlake: eval hit-rate failed: hit-rate 5.0 GB sglang-router: ")
    assert "KV tokens" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("argv", [
    ["serve", "--device", "cuda", "--kv-dtype", "bfloat16", "--control-port", "0", "--http-port", "0"],
    ["demo", "--device", "cuda:1", "--kv-dtype", "bfloat16"],
    ["bench", "e2e", "--device", "cuda", "--kv-dtype", "bfloat16", "--no-tier"],
    ["bench", "roundtrip", "--device", "cuda"],
])
def test_a_gpu_that_is_not_there_is_one_line_and_exit_2(argv, capsys):
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err)
    assert "sees no CUDA GPU" in err
