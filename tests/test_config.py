"""Settings of ``tokenlake serve`` (tokenlake/tools/config.py): default < file < env <
flag, unknown keys and wrong types refused with the key and its source named, ``tokenlake
config show``, one-line exit-2 errors, and defaults equal to those ``serve`` had before a
file existed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tokenlake.core.errors import ConfigError
from tokenlake.tools import cli
from tokenlake.tools.config import (
    RAY_STRATEGIES,
    SETTINGS,
    ServeSettings,
    configure_logging,
    env_var,
    file_key,
    flag_of,
    load_settings,
)

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = """\
model = "smollm2-135m"
instances = 8
pool_mb = 512
ports = "7500-7600"
log_level = "INFO"

[ray]
address = "auto"
strategy = "SPREAD"
cpus_per_instance = 2
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tokenlake.toml"
    path.write_text(EXAMPLE)
    return str(path)


def run(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err):
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenlake: error: "), err
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No TOKENLAKE_* setting of the machine running the tests leaks into them."""
    for name in SETTINGS:
        monkeypatch.delenv(env_var(name), raising=False)
    monkeypatch.delenv("TOKENLAKE_CONFIG", raising=False)


# --------------------------------------------------------------------------- precedence


def test_the_file_overrides_the_defaults(config_file):
    loaded = load_settings(config_file)
    s = loaded.settings
    assert (s.instances, s.pool_mb, s.ports, s.log_level) == (8, 512, (7500, 7600), "INFO")
    assert (s.ray_address, s.ray_strategy, s.ray_cpus_per_instance) == ("auto", "SPREAD", 2.0)
    assert loaded.sources["instances"] == "file" and loaded.sources["segment_tokens"] == "default"
    assert s.segment_tokens == ServeSettings().segment_tokens


def test_env_overrides_the_file_and_flags_override_both(config_file):
    env = {"TOKENLAKE_INSTANCES": "6", "TOKENLAKE_POOL_MB": "128", "TOKENLAKE_RAY_STRATEGY": "PACK"}
    flags = {"instances": "3", "ray_strategy": "STRICT_PACK"}
    loaded = load_settings(config_file, env, flags)
    s, src = loaded.settings, loaded.sources
    assert (s.instances, src["instances"]) == (3, "flag")        # file, env and flag: flag
    assert (s.pool_mb, src["pool_mb"]) == (128, "env")           # file and env: env
    assert (s.ray_strategy, src["ray_strategy"]) == ("STRICT_PACK", "flag")
    assert (s.ports, src["ports"]) == ((7500, 7600), "file")     # file only
    assert (s.max_rows, src["max_rows"]) == (1024, "default")


def test_each_setting_has_a_file_key_an_env_var_and_a_flag():
    assert [file_key(n) for n in ("instances", "ray_strategy")] == ["instances", "ray.strategy"]
    assert env_var("ray_cpus_per_instance") == "TOKENLAKE_RAY_CPUS_PER_INSTANCE"
    assert [flag_of(n) for n in ("pool_mb", "ray_address", "restart", "log_level")] == [
        "--pool-mb", "--ray", "--no-restart", "--log-level"]
    # the two variables serve read before the file existed keep their names
    assert env_var("bind") == "TOKENLAKE_BIND" and env_var("ports") == "TOKENLAKE_PORTS"


def test_an_empty_environment_variable_counts_as_unset():
    loaded = load_settings(None, {"TOKENLAKE_INSTANCES": ""})
    assert loaded.sources["instances"] == "default" and loaded.settings.instances == 4


def test_booleans_from_text():
    assert load_settings(None, {"TOKENLAKE_RESTART": "false"}).settings.restart is False
    assert load_settings(None, {"TOKENLAKE_RESTART": "yes"}).settings.restart is True
    with pytest.raises(ConfigError, match=r"restart must be true or false, got 'maybe' \(env "):
        load_settings(None, {"TOKENLAKE_RESTART": "maybe"})


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("text,needle", [
    ("instancs = 4\n", "unknown key 'instancs'"),
    ("[ray]\nstratgy = 'PACK'\n", "unknown key 'ray.stratgy'"),
    ("ray_strategy = 'PACK'\n", "unknown key 'ray_strategy'"),  # only inside [ray]
    ("[server]\nport = 1\n", "unknown key 'server'"),
])
def test_unknown_keys_in_the_file_are_refused_by_name(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_settings(str(path))


@pytest.mark.parametrize("text,needle", [
    ('instances = "four"\n', "instances must be an integer, got 'four' (file "),
    ("instances = 4.5\n", "instances must be an integer, got 4.5 (file "),
    ("instances = true\n", "instances must be an integer, got True (file "),
    ("model = 7\n", "model must be a string, got 7 (file "),
    ("restart = 'no'\n", "restart must be true or false, got 'no' (file "),
    ("[ray]\ncpus_per_instance = 'two'\n", "ray.cpus_per_instance must be a number"),
    ("ports = [1, 2, 3]\n", "ports must be a port range"),
    ("instances = 0\n", "instances must be > 0, got 0 (file "),
    ("log_level = 'LOUD'\n", "log_level must be one of DEBUG"),
])
def test_wrong_types_and_values_in_the_file_are_refused(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(str(path))
    assert needle in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("env,flags,needle", [
    ({"TOKENLAKE_INSTANCES": "four"}, {}, "instances must be an integer, got 'four' (env "
                                          "TOKENLAKE_INSTANCES)"),
    ({"TOKENLAKE_PORTS": "9000-8000"}, {}, "(env TOKENLAKE_PORTS)"),
    ({}, {"ray_engine_share": "0"}, "ray.engine_share must be in (0, 1], got 0.0 "
                                    "(flag --engine-share)"),
    ({}, {"model": "gpt-5"}, "model must be one of"),
    ({}, {"http_port": "7400"}, "control_port and http_port must differ"),
])
def test_bad_values_from_env_and_flags_name_their_source(env, flags, needle):
    with pytest.raises(ConfigError) as info:
        load_settings(None, env, flags)
    assert needle in str(info.value)


def test_the_settings_object_validates_itself():
    with pytest.raises(ConfigError, match="instances must be > 0"):
        ServeSettings(instances=0)
    with pytest.raises(ConfigError, match="pool_mb must be an integer"):
        ServeSettings(pool_mb="256")
    assert ServeSettings(ray_cpus_per_instance=2).ray_cpus_per_instance == 2.0  # int for float
    with pytest.raises(ConfigError, match="page_tokens .16. must divide segment_tokens .100."):
        ServeSettings(segment_tokens=100)
    assert ServeSettings(segment_tokens=100, page_tokens=100).page_tokens == 100


# --------------------------------------------------------------------------- command line


def test_config_show_prints_values_and_sources(config_file, monkeypatch, capsys):
    monkeypatch.setenv("TOKENLAKE_POOL_MB", "128")
    code, out, err = run(["config", "show", "--config", config_file, "--instances", "2"], capsys)
    assert code == 0 and not err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if not line.startswith("#")}
    assert rows["instances"] == ["2", "flag"]
    assert rows["pool_mb"] == ["128", "env"]
    assert rows["ray.strategy"] == ['"SPREAD"', "file"]
    assert rows["max_rows"] == ["1024", "default"]
    assert set(rows) == {file_key(n) for n in SETTINGS}
    assert f"# config file: {config_file}" in out


def test_config_show_json(config_file, monkeypatch, capsys):
    monkeypatch.setenv("TOKENLAKE_CONFIG", config_file)  # the file by environment
    code, out, _ = run(["config", "show", "--json", "--no-restart"], capsys)
    assert code == 0
    shown = json.loads(out)
    assert shown["instances"] == {"value": 8, "source": "file"}
    assert shown["ports"] == {"value": [7500, 7600], "source": "file"}
    assert shown["restart"] == {"value": False, "source": "flag"}
    assert shown["ray.address"] == {"value": "auto", "source": "file"}


@pytest.mark.parametrize("command", [["config", "show"], ["serve"]])
@pytest.mark.parametrize("text", ["instances = \n", "instancs = 4\n", "instances = 'x'\n"])
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, command, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, out, err = run([*command, "--config", str(path)], capsys)
    assert_one_line_error(code, err)
    assert str(path) in err and out == ""


def test_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    code, _, err = run(["config", "show", "--config", str(tmp_path / "none.toml")], capsys)
    assert_one_line_error(code, err)
    assert "not found" in err


def test_serve_with_clashing_ports_is_one_line_and_exit_2(capsys):
    code, _, err = run(["serve", "--control-port", "8000", "--http-port", "8000"], capsys)
    assert_one_line_error(code, err)
    assert "must differ" in err


def test_log_level_configures_logging():
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        configure_logging("DEBUG")
        assert root.level == logging.DEBUG
        configure_logging("ERROR")
        assert root.level == logging.ERROR
    finally:
        for handler in root.handlers:
            root.removeHandler(handler)
        root.setLevel(before[0])
        for handler in before[1]:
            root.addHandler(handler)


# --------------------------------------------------------------------------- defaults


def test_defaults_are_those_serve_had_before_the_file():
    s = ServeSettings()
    assert (s.model, s.instances, s.pool_mb, s.segment_tokens, s.max_rows) == (
        "smollm2-135m", 4, 256, 64, 1024)
    assert (s.bind, s.ports, s.restart, s.ray_address) == ("127.0.0.1", None, True, None)
    assert (s.host, s.control_port, s.http_port) == ("127.0.0.1", 7400, 8000)
    assert (s.ray_strategy, s.ray_cpus_per_instance, s.ray_gpus_per_instance,
            s.ray_engine_share) == ("PACK", 1.0, 0, 1.0)


def test_serve_passes_the_same_values_as_before(monkeypatch, capsys):
    pytest.importorskip("ray")
    import tokenlake.deploy.ray as deploy_ray  # Ray is heavy: only this test imports it
    from tokenlake.deploy.ray.options import STRATEGIES, RayOptions

    assert RAY_STRATEGIES == STRATEGIES
    calls = []
    monkeypatch.setattr(deploy_ray, "serve", lambda *a, **kw: calls.append((a, kw)) or 0)
    monkeypatch.setattr("signal.signal", lambda *_: None)  # keep pytest's own handlers
    monkeypatch.setattr("tokenlake.tools.cli.pool.configure_logging", lambda level: None)
    assert run(["serve", "--ray", "auto"], capsys)[0] == 0
    (args, kwargs), = calls
    # a pool on its own control port is named after it, to outlive its driver (issue #40)
    named = {"name": "serve-7400", "orphan_grace_s": 60.0}
    assert args == (4, "smollm2-135m", 256 << 20, RayOptions(address="auto", **named), 64, 1024)
    assert kwargs["restart"] is True and kwargs["json_lines"] is False
    assert kwargs["page_tokens"] == 16
    assert kwargs["state_file"].endswith("pool-7400.json")
    assert run(["serve", "--ray", "local", "--no-restart"], capsys)[0] == 0
    assert calls[1][0][3] == RayOptions(address=None, **named) and calls[1][1]["restart"] is False
    assert run(["serve", "--ray", "auto", "--place-timeout", "2.5"], capsys)[0] == 0
    assert calls[2][0][3] == RayOptions(address="auto", place_timeout_s=2.5, **named)
    assert run(["serve", "--ray", "auto", "--insecure"], capsys)[0] == 0  # a switch that turns on
    assert calls[3][0][3] == RayOptions(address="auto", insecure=True, **named)
    assert run(["serve", "--ray", "auto", "--control-port", "0", "--orphan-grace-s", "5"], capsys)[0] == 0
    assert calls[4][0][3] == RayOptions(address="auto", orphan_grace_s=5.0)  # no name: no restart
    assert calls[4][1]["state_file"] is None


# --------------------------------------------------------------------------- docs and layering


def test_the_readme_example_is_a_valid_file(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    example = text.split("```toml\n# tokenlake.toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "tokenlake.toml"
    path.write_text(example)
    loaded = load_settings(str(path))
    # not in it: two defaults, the disk tier, which a pool on Ray (as the example) has not,
    # and the device (a pool on Ray is on the CPU)
    skip = ("max_rows", "restart", "tier_path", "tier_mb", "tier_write_mbps", "device")
    assert all(loaded.sources[n] == "file" for n in SETTINGS if n not in skip)
    assert loaded.settings.ports == (47000, 47019) and loaded.settings.ray_address == "auto"


def test_no_library_module_reads_a_setting_from_the_environment():
    names = [env_var(n) for n in SETTINGS] + ["TOKENLAKE_CONFIG"]
    readers = []
    for pkg in ("tokenlake", "query_engine", "transfer_engine", "scheduler", "evals"):
        for path in (ROOT / pkg).rglob("*.py"):
            if (ROOT / "tokenlake" / "tools") in path.parents:
                continue  # the command line and its tools: the entry points that read them
            text = path.read_text(encoding="utf-8")
            readers += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in text]
    assert not readers, readers
