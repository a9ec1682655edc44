"""``tokenlake config show`` and the settings flags that ``serve`` shares with it.

The command line is the entry point that reads the environment: it hands ``os.environ``
and ``--config FILE`` (or ``TOKENLAKE_CONFIG``) to
:func:`tokenlake.tools.config.load_settings`.
"""

from __future__ import annotations

import argparse
import json
import os

from tokenlake.tools.config import (
    CONFIG_ENV,
    DEFAULTS,
    SETTINGS,
    LoadedSettings,
    env_var,
    flag_of,
    load_settings,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``config show`` to the command tree."""
    config = sub.add_parser(
        "config", help="the settings of 'tokenlake serve'",
        description="The settings of 'tokenlake serve': defaults, a TOML file (--config), "
                    "TOKENLAKE_* environment variables over it, flags over both.")
    show = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    p = show.add_parser(
        "show", help="print the effective settings and where each came from",
        description="Prints every setting of 'tokenlake serve' with its effective value and "
                    "its source: default, file, env or flag.")
    add_settings_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print {key: {value, source}} as JSON")
    p.set_defaults(run=run_show)


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and one flag per setting; a flag not given stays ``None`` so
    that the file and the environment show through (:func:`settings_from_args`)."""
    p.add_argument("--config", metavar="FILE",
                   help=f"TOML file of settings (env {CONFIG_ENV}; unset: none)")
    for name, f in SETTINGS.items():
        meta = f.metadata
        default = getattr(DEFAULTS, name)
        shown = "unset" if default is None else str(default).lower() if meta["kind"] == "bool" \
            else default
        words = f"{meta['help']}; default {shown}; env {env_var(name)}"
        if meta["choices"]:
            words += f"; one of: {', '.join(meta['choices'])}"
        if meta["kind"] == "bool":  # a switch: --no-restart turns off, --insecure on
            p.add_argument(flag_of(name), dest=name, action="store_const",
                           const="false" if default else "true",
                           default=None, help=words.replace("%", "%%"))
        else:
            p.add_argument(flag_of(name), dest=name, default=None,
                           metavar=meta["metavar"] or name.removeprefix("ray_").upper(),
                           help=words.replace("%", "%%"))


def settings_from_args(args: argparse.Namespace) -> LoadedSettings:
    """The effective settings of a command parsed with :func:`add_settings_flags`:
    default < file < environment < flags (``ConfigError`` on a mistake: exit 2)."""
    flags = {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}
    config_file = args.config or os.environ.get(CONFIG_ENV) or None
    return load_settings(config_file, os.environ, flags)


def run_show(args: argparse.Namespace) -> int:
    loaded = settings_from_args(args)
    rows = loaded.rows()
    if args.json:
        print(json.dumps({key: {"value": value, "source": source}
                          for key, value, source in rows}, indent=2))
        return 0
    if loaded.config_file:
        print(f"# config file: {loaded.config_file}")
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        text = "unset" if value is None else json.dumps(value)
        print(f"{key:<{width}}  {text:<24}  {source}")
    return 0
