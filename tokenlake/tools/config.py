"""Settings of ``tokenlake serve``: one TOML file, ``TOKENLAKE_*`` environment variables
over it, command-line flags over both (docs/design.md §4 "Configuration").

:class:`ServeSettings` is the command's one typed, frozen settings object (the serve
command turns it into the service's :class:`tokenlake.service.config.ServeConfig` and
its :class:`~tokenlake.deploy.config.ClusterConfig`); :func:`load_settings` merges the
four sources (default < file < env < flag) and remembers where each value came from. Each setting has one name and three spellings:

* in the file, its name (``instances = 4``); a ``ray_`` setting lives in the ``[ray]``
  table without the prefix (``[ray] strategy = "SPREAD"``);
* in the environment, ``TOKENLAKE_`` + its name in capitals (``TOKENLAKE_RAY_STRATEGY``);
* on the command line, its flag (:func:`flag_of`: ``--pool-mb``, ``--ray``, ``--no-restart``).

This module reads no environment and no file by itself: the command line (the entry
point) passes ``os.environ`` and the file's path in. Errors are
:class:`~tokenlake.core.errors.ConfigError`, one line naming the setting and its source.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType

from tokenlake.core.config import is_device, is_int
from tokenlake.core.control import KV_DTYPES, KV_LAYOUTS
from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import list_models

try:  # the standard library's TOML reader is Python 3.11+; 3.10 runs without --config
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = None

ENV_PREFIX = "TOKENLAKE_"
CONFIG_ENV = "TOKENLAKE_CONFIG"  # the file, when --config is not given
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RAY_TABLE = "ray"
ENGINES = ("pool", "reference")
COMPUTE = ("one", "per-instance")

Check = Callable[[object], "str | None"]  # a value's fault in words, or None when fine


def _positive(value) -> str | None:
    return None if value > 0 else f"must be > 0, got {value!r}"


def _at_least_zero(value) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value!r}"


def _port(value) -> str | None:
    return None if 1 <= value <= 65535 else f"must be a port in 1..65535, got {value!r}"


def _port_or_any(value) -> str | None:
    return None if 0 <= value <= 65535 else f"must be a port in 0..65535, got {value!r}"


def _share(value) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value!r}"


def _address(value) -> str | None:
    if value and not any(c.isspace() or c == "/" for c in value):
        return None
    return f"must be an address or an interface name, got {value!r}"


def _device(value) -> str | None:
    return None if is_device(value) else f"must be 'cpu', 'cuda' or 'cuda:N', got {value!r}"


def _port_pair(value) -> str | None:
    if value is None or 1 <= value[0] <= value[1] <= 65535:
        return None
    return f"must be FIRST-LAST with 1 <= FIRST <= LAST <= 65535, got {value[0]}-{value[1]}"


def _one_of(names: tuple[str, ...]) -> Check:
    return lambda value: None if value in names else f"must be one of {', '.join(names)}; got {value!r}"


def _setting(default, kind: str, help: str, check: Check | None = None, flag: str = "",
             metavar: str = "", choices: tuple[str, ...] = ()):
    """A field of :class:`ServeSettings`. ``kind``: ``int``, ``float``, ``str``, ``bool``
    or ``ports`` (a ``(first, last)`` range; ``FIRST-LAST`` as text); ``choices``: the
    valid names, when only those are valid."""
    return field(default=default, metadata={
        "kind": kind, "help": help, "check": _one_of(choices) if choices else check,
        "flag": flag, "metavar": metavar, "choices": choices})


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``tokenlake serve`` needs, validated at construction (:class:`ConfigError`).

    The defaults are those of ``tokenlake serve`` before a file existed. Units: MiB for
    ``pool_mb``, tokens for ``segment_tokens``, rows for ``max_rows``, CPUs and GPUs (Ray
    resources) for ``ray_*_per_instance``; the ``http_*`` limits are those of
    :class:`~tokenlake.service.limits.HttpLimits` (:meth:`http_limits`).
    """

    model: str = _setting("smollm2-135m", "str", "model whose KV the pool holds",
                          choices=tuple(list_models()), metavar="NAME")
    instances: int = _setting(4, "int", "pool instances", _positive, metavar="N")
    pool_mb: int = _setting(256, "int", "slab MiB per instance", _positive, metavar="MIB")
    segment_tokens: int = _setting(64, "int", "tokens per segment", _positive, metavar="TOKENS")
    page_tokens: int = _setting(16, "int", "prefix hits exact to this many tokens; must divide "
                                "segment_tokens (segment_tokens: whole segments only)", _positive,
                                metavar="TOKENS")
    kv_dtype: str = _setting("float32", "str", "element type of the pool's K/V: 'float32', "
                             "'bfloat16' or 'float16' (half the bytes per token; attention math "
                             "stays float32)", choices=tuple(KV_DTYPES), metavar="DTYPE")
    bf16_products: int = _setting(0, "int", "bfloat16 pools on CPUs with AVX-512 BF16 and no AMX: "
                                  "many grouped rows attend with q in this many bfloat16 parts (1 or 2) and the "
                                  "probabilities rounded, as GPU kernels do (0: exact products)",
                                  lambda v: None if v in (0, 1, 2) else f"must be 0, 1 or 2, got {v!r}", metavar="PARTS")
    device: str = _setting("cpu", "str", "where the model and the pool's buffers live: 'cpu', "
                           "'cuda' (the instances spread over the visible GPUs) or 'cuda:N' (all on "
                           "GPU N): the model's matrices, activations, slabs and hand-off buffers on "
                           "the GPU; needs a half kv_dtype, which the model's matrices take too", _device, metavar="DEVICE")
    max_rows: int = _setting(1024, "int", "rows of each q/out/kv buffer", _positive,
                          metavar="ROWS")
    tier_mb: int = _setting(0, "int", "MiB per instance of a tier below the slab, where evicted "
                            "segments wait to be read back (0: none, they are dropped); in "
                            "host memory unless tier_path is set", _at_least_zero, metavar="MIB")
    tier_path: str | None = _setting(None, "str", "directory of the instances' tiers on a local "
                                     "disk (needs tier_mb); what it holds outlives the service",
                                     metavar="DIR")
    tier_write_mbps: int = _setting(1024, "int", "MiB a second each instance's disk tier may "
                                    "write (0: as fast as the disk takes them); segments that "
                                    "come faster wait in memory, up to 256 MiB, then have no copy",
                                    _at_least_zero, metavar="MIB_S")
    host: str = _setting("127.0.0.1", "str", "address of the control and HTTP ports",
                         _address, metavar="ADDRESS")
    control_port: int = _setting(7400, "int", "control port (typed wire messages; 0: any "
                                 "free port, printed at start)", _port_or_any, metavar="PORT")
    http_port: int = _setting(8000, "int", "HTTP port (OpenAI-compatible API, metrics; 0: any "
                              "free port, printed at start)", _port_or_any, metavar="PORT")
    http_max_body_kib: int = _setting(4096, "int", "largest HTTP request body, KiB (413 above; "
                                      "the Content-Length is checked before reading)",
                                      _positive, metavar="KIB")
    http_body_timeout_s: float = _setting(10.0, "float", "seconds an HTTP request body may take "
                                          "to arrive in full (408 after)", _positive,
                                          flag="--http-body-timeout", metavar="S")
    http_max_prompt_tokens: int | None = _setting(None, "int", "most prompt tokens of an HTTP "
                                                  "request (unset: the model's context); a "
                                                  "text prompt too long to fit is refused "
                                                  "before it is tokenized", _positive,
                                                  metavar="TOKENS")
    http_max_stop_chars: int = _setting(1000, "int", "most characters of one stop string "
                                        "(at most 4 strings)", _positive, metavar="CHARS")
    engine: str = _setting("pool", "str", "what serves the HTTP API: 'pool' (the model through the "
                           "pool) or 'reference' (the same model, no pool, no prefix cache: the "
                           "baseline)", choices=ENGINES, metavar="NAME")
    compute: str = _setting("one", "str", "the model's compute on a local pool: 'one' engine for "
                            "all instances (continuous batching; on few cores a split does not "
                            "pay) or 'per-instance' (an engine per instance, each on its own "
                            "thread: the goodput DP, prefills split over instances)",
                            choices=COMPUTE, metavar="HOW")
    kv_layout: str = _setting("tokenlake", "str", "whose KV the pool holds: 'tokenlake' (its own "
                              "engines, with the HTTP API), 'vllm-cpu' (vLLM's CPU pages: the vLLM connector's load "
                              "mode) or 'hf' (vLLM's K/V rows, attended in the pool: its query "
                              "mode); the vLLM layouts have no HTTP API", choices=KV_LAYOUTS,
                              metavar="NAME")
    bind: str = _setting("127.0.0.1", "str", "engine address: IP, interface name or 'node'",
                         _address, metavar="WHAT")
    ports: tuple[int, int] | None = _setting(None, "ports", "engine port range (unset: any "
                                             "free port)", _port_pair, metavar="FIRST-LAST")
    orphan_grace_s: float = _setting(60.0, "float", "seconds the engines keep the cache when this "
                                     "process dies, waiting for a restart on the same control "
                                     "port to adopt them (0: they stop with it; control_port 0: "
                                     "no restart can find them)", _at_least_zero,
                                     flag="--orphan-grace-s", metavar="S")
    restart: bool = _setting(True, "bool", "restart failed instances (--no-restart or false: remove "
                             "them only)",
                             flag="--no-restart")
    insecure: bool = _setting(False, "bool", "no CURVE: the engines and the control port accept "
                              "anyone who reaches them (trusted networks only; docs/security.md)",
                              flag="--insecure")
    credentials: str | None = _setting(None, "str", "file to write the control port's credentials "
                                       "to, mode 0600 (unset: $TOKENLAKE_HOME/serve-PORT.json, "
                                       "where tokenlake.connect looks)", metavar="FILE")
    log_level: str = _setting("WARNING", "str", "logging level of the service",
                              choices=LOG_LEVELS, metavar="LEVEL")
    ray_address: str | None = _setting(None, "str", "Ray cluster to join: 'auto', the head's "
                                       "HOST:PORT, or 'local' (this machine's Ray, or a new one)",
                                       flag="--ray", metavar="ADDRESS")
    ray_strategy: str = _setting("PACK", "str", "placement-group strategy of the per-instance "
                                 "bundles", choices=RAY_STRATEGIES, flag="--strategy",
                                 metavar="NAME")
    ray_cpus_per_instance: float = _setting(1.0, "float", "CPUs of each instance's bundle",
                                            _positive, flag="--cpus-per-instance",
                                            metavar="CPUS")
    ray_gpus_per_instance: int = _setting(0, "int", "GPUs of each instance's bundle",
                                          _at_least_zero, flag="--gpus-per-instance",
                                          metavar="GPUS")
    ray_engine_share: float = _setting(1.0, "float", "share of each bundle for the pool's "
                                       "actors (rest: compute engine)", _share,
                                       flag="--engine-share", metavar="SHARE")
    ray_place_timeout_s: float = _setting(10.0, "float", "seconds to wait for Ray to place bundles "
                                          "that fit but whose resources are busy", _positive,
                                          flag="--place-timeout", metavar="S")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["kind"] == "float" and is_int(value):  # 2 CPUs: 2.0
                value = float(value)
                object.__setattr__(self, f.name, value)
            _check_type(f.name, f.metadata["kind"], value, f.default is None)
            fault = value is not None and f.metadata["check"] and f.metadata["check"](value)
            if fault:
                raise ConfigError(f"{file_key(f.name)} {fault}")
        if self.segment_tokens % self.page_tokens:
            raise ConfigError(f"page_tokens ({self.page_tokens}) must divide segment_tokens "
                              f"({self.segment_tokens})")
        if self.control_port == self.http_port != 0:
            raise ConfigError(f"control_port and http_port must differ, both are {self.http_port}")
        if self.tier_path is not None and self.tier_mb == 0:
            raise ConfigError("tier_path needs tier_mb (what each instance's disk tier may hold)")

    def http_limits(self):
        """The ``http_*`` settings as the HTTP front door's
        :class:`~tokenlake.service.limits.HttpLimits`."""
        from tokenlake.service.limits import HttpLimits

        return HttpLimits(max_body_bytes=self.http_max_body_kib << 10,
                          body_timeout_s=self.http_body_timeout_s,
                          max_prompt_tokens=self.http_max_prompt_tokens,
                          max_stop_chars=self.http_max_stop_chars)

    def to_dict(self) -> dict[str, object]:
        """The settings as JSON-ready values, keyed by setting name (ports as a list)."""
        out = asdict(self)
        if self.ports is not None:
            out["ports"] = list(self.ports)
        return out


_IS_KIND: dict[str, Callable[[object], bool]] = {
    "int": is_int,
    "float": lambda v: isinstance(v, float),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "ports": lambda v: isinstance(v, tuple) and len(v) == 2 and all(map(is_int, v)),
}


def _check_type(name: str, kind: str, value, optional: bool) -> None:
    """Raises :class:`ConfigError` unless ``value`` is of ``kind`` (or ``None``, when optional)."""
    if not (value is None and optional) and not _IS_KIND[kind](value):
        raise ConfigError(f"{file_key(name)} must be {_KIND_WORDS[kind]}, got {value!r}")


_KIND_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false", "ports": "a port range FIRST-LAST"}
SETTINGS = {f.name: f for f in fields(ServeSettings)}
DEFAULTS = ServeSettings()


def file_key(name: str) -> str:
    """A setting's key in the file: ``instances``, or ``ray.strategy`` for ``ray_strategy``."""
    return f"{RAY_TABLE}.{name.removeprefix('ray_')}" if name.startswith("ray_") else name


def env_var(name: str) -> str:
    """A setting's environment variable: ``TOKENLAKE_`` + the name in capitals."""
    return ENV_PREFIX + name.upper()


def flag_of(name: str) -> str:
    """A setting's command-line flag: its own (``--ray``), else ``--`` + the name in kebab case."""
    return SETTINGS[name].metadata["flag"] or "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- parsing


def _from_text(kind: str, text: str):
    """A value of ``kind`` from an environment variable or a flag; ``ValueError`` if none."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        word = text.strip().lower()
        if word not in _BOOL_WORDS:
            raise ValueError(text)
        return _BOOL_WORDS[word]
    if kind == "ports":
        first, _, last = text.partition("-")
        return int(first), int(last or first)
    return text


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _from_toml(kind: str, value):
    """A value of ``kind`` from the file; TOML's own types must match (``ValueError``)."""
    if kind == "float" and is_int(value):
        return float(value)
    if kind == "ports":
        if isinstance(value, str):
            return _from_text("ports", value)
        if not (isinstance(value, list) and len(value) == 2):
            raise ValueError(value)
        return tuple(value)
    return value  # its type is checked by _parse


def _parse(name: str, raw, where: str, from_text: bool):
    """One value of setting ``name`` from a source; a :class:`ConfigError` naming both."""
    f = SETTINGS[name]
    kind = f.metadata["kind"]
    try:
        value = _from_text(kind, raw) if from_text else _from_toml(kind, raw)
        _check_type(name, kind, value, optional=False)
    except (ValueError, ConfigError):
        raise ConfigError(f"{file_key(name)} must be {_KIND_WORDS[kind]}, got {raw!r} "
                          f"({where})") from None
    fault = f.metadata["check"] and f.metadata["check"](value)
    if fault:
        raise ConfigError(f"{file_key(name)} {fault} ({where})")
    return value


def read_config_file(path: str) -> dict[str, object]:
    """The raw values of a TOML file by setting name; unknown keys and bad TOML refused."""
    if tomllib is None:  # pragma: no cover - Python 3.10
        raise ConfigError("a config file needs Python 3.11 or newer (tomllib)")
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path!r}: {exc}") from None
    flat: dict[str, object] = {}
    unknown: list[str] = []
    for key, value in data.items():
        if key == RAY_TABLE:
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path!r}: {RAY_TABLE!r} must be a table ([ray])")
            for sub, sub_value in value.items():
                flat[f"ray_{sub}"] = sub_value
                if f"ray_{sub}" not in SETTINGS:
                    unknown.append(f"{RAY_TABLE}.{sub}")
        else:  # a ray_ setting is known in the [ray] table only
            flat[key] = value
            if key not in SETTINGS or key.startswith("ray_"):
                unknown.append(key)
    if unknown:
        known = ", ".join(file_key(n) for n in SETTINGS)
        raise ConfigError(f"config file {path!r}: unknown key {unknown[0]!r} (known: {known})")
    return flat


@dataclass(frozen=True)
class LoadedSettings:
    """The effective settings and where each came from.

    Attributes:
        settings: the merged, validated settings.
        sources: setting name -> ``default``, ``file``, ``env`` or ``flag``.
        config_file: the file read, or ``None``.
    """

    settings: ServeSettings
    sources: Mapping[str, str]
    config_file: str | None = None

    def rows(self) -> list[tuple[str, object, str]]:
        """``(file key, value, source)`` of every setting, in declaration order."""
        values = self.settings.to_dict()
        return [(file_key(n), values[n], self.sources[n]) for n in SETTINGS]


def load_settings(config_file: str | None = None, environ: Mapping[str, str] | None = None,
                  flags: Mapping[str, str] | None = None) -> LoadedSettings:
    """Merges default < ``config_file`` < ``environ`` (``TOKENLAKE_*``) < ``flags``.

    ``flags`` maps setting names to the text given on the command line (absent: not
    given); an empty environment variable counts as unset. Raises :class:`ConfigError`,
    one line naming the setting and its source, for an unreadable file, an unknown key,
    a wrong type or a bad value.
    """
    values: dict[str, object] = {}
    sources = dict.fromkeys(SETTINGS, "default")
    if config_file is not None:
        for name, raw in read_config_file(config_file).items():
            values[name] = _parse(name, raw, f"file {config_file}", from_text=False)
            sources[name] = "file"
    for name in SETTINGS:
        text = (environ or {}).get(env_var(name), "")
        if text:
            values[name] = _parse(name, text, f"env {env_var(name)}", from_text=True)
            sources[name] = "env"
    for name, text in (flags or {}).items():
        values[name] = _parse(name, text, f"flag {flag_of(name)}", from_text=True)
        sources[name] = "flag"
    try:
        settings = ServeSettings(**values)
    except ConfigError as exc:  # a rule over several settings
        where = ", ".join(sorted({sources[n] for n in ("control_port", "http_port")}))
        raise ConfigError(f"{exc} ({where})") from None
    return LoadedSettings(settings, MappingProxyType(sources), config_file)


def configure_logging(level: str) -> None:
    """Sends the service's ``logging`` records at ``level`` and above to stderr."""
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
