"""The pool's settings as one object per layer: :class:`ClusterConfig` (deploy) validated
once with errors that name the field, the launchers' two constructor forms giving equal
configs and the same defaults as before, and the service's :class:`ServeConfig` that
``tokenlake serve`` builds from what ``tokenlake config show`` prints. Nothing is started."""

from __future__ import annotations

import dataclasses

import pytest
from dataplane_util import TINY

from tokenlake.core.errors import ConfigError
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.local import LocalCluster

C = 16
POOL = 40 * ClusterConfig(1, TINY, 1 << 30, segment_tokens=C).segment_bytes  # 40 slots


def config(**fields) -> ClusterConfig:
    return ClusterConfig(**{"instances": 2, "model": TINY, "pool_bytes": POOL, "segment_tokens": C, **fields})


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("fields", "named"), [
    ({"instances": 0}, "instance"),
    ({"instances": 1.5}, "instance"),
    ({"pool_bytes": 100}, "pool_bytes"),
    ({"segment_tokens": 0}, "segment_tokens"),
    ({"max_rows": -1}, "max_rows"),
    ({"page_tokens": 5}, "page_tokens"),
    ({"kv_dtype": "int8"}, "kv_dtype"),
    ({"kv_layout": "paged"}, "kv_layout"),
    ({"device": "mps"}, "device"),
    ({"device": "cuda"}, "kv_dtype"),  # a GPU pool holds half K/V
    ({"timeout_s": 0}, "timeout_s"),
    ({"peer_timeout_s": -1.0}, "peer_timeout_s"),
    ({"start_timeout_s": 0}, "start_timeout_s"),
    ({"host": "two words"}, "host"),
    ({"host": ""}, "host"),
    ({"insecure": "yes"}, "insecure"),
    ({"share_slabs": None}, "share_slabs"),
])
def test_a_bad_value_is_refused_naming_its_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        config(**fields)


def test_the_launchers_messages_are_kept():
    with pytest.raises(ConfigError, match="need at least one instance"):
        config(instances=0)
    with pytest.raises(ConfigError, match=r"holds no \d+-byte segment"):
        config(pool_bytes=POOL // 40 - 1)
    with pytest.raises(ConfigError, match="float16 or bfloat16"):
        config(device="cuda:1")
    assert config(device="cuda:1", kv_dtype="bfloat16").device == "cuda:1"


def test_a_config_is_frozen_and_sizes_the_pool():
    cfg = config(kv_dtype="bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.instances = 3
    assert cfg.slots_per_instance == 80  # half the bytes per element: twice the segments
    assert config().slots_per_instance == 40
    assert config(share_slabs=0).share_slabs is False  # as bool() took it before
    with pytest.raises(ConfigError, match="max_rows"):
        dataclasses.replace(cfg, max_rows=0)  # a changed copy is checked again


# ---------------------------------------------------------------- the launchers' forms


def test_both_local_forms_give_equal_configs_and_the_old_defaults():
    old = LocalCluster(2, TINY, POOL, segment_tokens=C, max_rows=64, kv_dtype="float16", seed=3)
    new = LocalCluster(config(max_rows=64, kv_dtype="float16", seed=3))
    assert old.config == new.config
    positional = LocalCluster(2, TINY, POOL, C, 64, kv_dtype="float16", seed=3)
    assert positional.config == new.config
    for cluster in (old, new):  # what the old parameter list defaulted to
        assert cluster.share_slabs and cluster.host == "127.0.0.1" and not cluster.insecure
        assert (cluster.timeout_s, cluster.peer_timeout_s, cluster.start_timeout_s) == (5.0, 2.0, 60.0)
        assert cluster.query_threads == 2 and cluster.orphan_grace_s == 0.0 and cluster.state_file is None
        assert cluster.slots_per_instance == 40 * 2 and cluster.kv_layout == "tokenlake"
    defaults = LocalCluster(1, TINY, POOL).config
    assert (defaults.segment_tokens, defaults.max_rows, defaults.seed) == (64, 1024, 0)
    assert not LocalCluster(config(share_slabs=False)).share_slabs


def test_the_forms_do_not_mix():
    with pytest.raises(TypeError, match="comes alone"):
        LocalCluster(config(), seed=1)
    with pytest.raises(TypeError, match="by position"):
        LocalCluster(2, TINY, POOL, C, 64, 0)  # the old list's clock and seed go by name
    with pytest.raises(TypeError):
        LocalCluster(2, TINY, POOL, no_such_setting=1)
    with pytest.raises(ConfigError, match="query_threads"):
        LocalCluster(config(), query_threads=0)


def test_both_ray_forms_give_equal_configs_and_keep_rays_defaults():
    pytest.importorskip("ray")
    from tokenlake.deploy.ray import RayCluster, RayOptions

    options = RayOptions(host="node", insecure=True)
    old = RayCluster(2, TINY, POOL, segment_tokens=C, options=options, page_tokens=8)
    new = RayCluster(config(host="node", insecure=True, page_tokens=8), options=options)
    assert old.config == new.config and old.options == new.options
    assert RayCluster(config(host="node", insecure=True, page_tokens=8)).options.host == "node"
    for cluster in (old, new):
        assert cluster.host == "node" and cluster.insecure and cluster.keys is None
        assert cluster.start_timeout_s == 120.0  # Ray's default: a worker per actor imports torch
        assert not cluster.share_slabs  # its instances may be on several nodes
    with pytest.raises(ConfigError, match="options"):
        RayCluster(config(), options=options)  # the config binds loopback, the options "node"
    with pytest.raises(ConfigError, match="device"):
        RayCluster(config(device="cuda", kv_dtype="bfloat16"))
    with pytest.raises(ConfigError, match="kv_layout"):
        RayCluster(config(kv_layout="hf"))


# ------------------------------------------------------------------ the service's config


def test_the_serve_config_is_validated_naming_the_field_and_frozen():
    from tokenlake.service.config import ServeConfig
    from tokenlake.service.limits import HttpLimits

    pool = config()
    settings = ServeConfig(pool)
    assert (settings.control_port, settings.http_port, settings.orphan_grace_s) == (7400, 8000, 60.0)
    assert settings.limits == HttpLimits() and settings.engine == "pool" and settings.compute == "one"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.http_port = 1
    for fields, named in [({"control_port": 70000}, "control_port"), ({"http_port": -1}, "http_port"),
                          ({"control_port": 9000, "http_port": 9000}, "must differ"),
                          ({"engine": "vllm"}, "engine"), ({"compute": "two"}, "compute"),
                          ({"orphan_grace_s": -1}, "orphan_grace_s"), ({"host": ""}, "host"),
                          ({"limits": {"max_body_bytes": 1}}, "limits")]:
        with pytest.raises(ConfigError, match=named):
            ServeConfig(pool, **fields)
    with pytest.raises(ConfigError, match="cluster"):
        ServeConfig({"instances": 2})
    assert ServeConfig(pool, control_port=0, http_port=0).http_port == 0  # any free port, both


def test_the_serve_command_serves_the_settings_config_show_prints(monkeypatch, capsys):
    """``tokenlake serve`` hands ``serve_local`` one ``ServeConfig`` built from exactly
    the values ``tokenlake config show`` prints for the same file, environment and flags."""
    import json
    import signal

    import tokenlake.service.serve as serve_module
    from tokenlake.tools import cli
    from tokenlake.tools.cli import pool as pool_command
    from tokenlake.tools.config import SETTINGS, env_var

    for name in SETTINGS:
        monkeypatch.delenv(env_var(name), raising=False)
    monkeypatch.delenv("TOKENLAKE_CONFIG", raising=False)
    monkeypatch.setenv("TOKENLAKE_INSTANCES", "3")
    monkeypatch.setenv("TOKENLAKE_HTTP_MAX_STOP_CHARS", "50")
    served = []
    monkeypatch.setattr(serve_module, "serve_local", lambda settings, **_: served.append(settings))
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the command's SIGTERM handler
    monkeypatch.setattr(pool_command, "configure_logging", lambda level: None)
    argv = ["--pool-mb", "64", "--segment-tokens", "128", "--page-tokens", "32", "--max-rows", "512",
            "--bind", "0.0.0.0", "--insecure", "--control-port", "0", "--http-port", "8123",
            "--kv-dtype", "bfloat16", "--compute", "per-instance", "--orphan-grace-s", "5",
            "--http-max-body-kib", "8", "--credentials", "/tmp/creds.json"]
    assert cli.main(["config", "show", "--json", *argv]) == 0
    shown = {key: row["value"] for key, row in json.loads(capsys.readouterr().out).items()}
    assert cli.main(["serve", *argv]) == 0
    (settings,) = served
    pool = settings.cluster
    assert (pool.instances, pool.model.name, pool.pool_bytes, pool.segment_tokens, pool.max_rows,
            pool.page_tokens, pool.kv_dtype, pool.kv_layout, pool.host, pool.insecure) == (
        shown["instances"], shown["model"], shown["pool_mb"] << 20, shown["segment_tokens"],
        shown["max_rows"], shown["page_tokens"], shown["kv_dtype"], shown["kv_layout"], shown["bind"],
        shown["insecure"])
    assert pool.instances == 3 and pool.host == "0.0.0.0" and pool.share_slabs  # env, flag, default
    assert (settings.host, settings.control_port, settings.http_port, settings.engine, settings.compute,
            settings.credentials, settings.orphan_grace_s) == (
        shown["host"], shown["control_port"], shown["http_port"], shown["engine"], shown["compute"],
        shown["credentials"], shown["orphan_grace_s"])
    limits = settings.limits
    assert (limits.max_body_bytes, limits.body_timeout_s, limits.max_prompt_tokens, limits.max_stop_chars) == (
        shown["http_max_body_kib"] << 10, shown["http_body_timeout_s"], shown["http_max_prompt_tokens"],
        shown["http_max_stop_chars"])
