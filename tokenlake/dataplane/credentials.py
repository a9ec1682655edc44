"""The credentials file of a served pool: what a client needs to reach its control port.

``tokenlake serve`` writes ``{"address": "tcp://HOST:PORT", "keys": {...}}`` (the
member's CURVE keys, see :mod:`tokenlake.dataplane.auth`) to a file only its user can
read, and removes it when it stops. ``tokenlake.connect(address)`` finds it without being
told: it reads the ``credentials`` argument or else ``$TOKENLAKE_HOME/serve-PORT.json``
(``TOKENLAKE_HOME`` defaults to ``~/.tokenlake``). Copy the file there (or pass its path)
to reach the pool from another machine.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tokenlake.core.errors import ConfigError
from tokenlake.dataplane.auth import ClusterKeys


def home() -> Path:
    """``$TOKENLAKE_HOME``, or ``~/.tokenlake``."""
    return Path(os.environ.get("TOKENLAKE_HOME") or Path.home() / ".tokenlake")


def default_path(address: str) -> Path:
    """Where ``tokenlake serve`` writes the credentials of the control port ``address``."""
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit():
        raise ConfigError(f"control address must be tcp://HOST:PORT, got {address!r}")
    return home() / f"serve-{port}.json"


def write(path: str | os.PathLike, creds: dict[str, Any]) -> Path:
    """Writes ``creds`` to ``path`` with mode 0600 (created that way, then renamed into
    place, so no other user can read it at any moment); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(creds, f)
    os.replace(tmp, path)
    return path


def remove(path: str | os.PathLike | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def load(source: str | os.PathLike | dict | ClusterKeys | None, address: str) -> ClusterKeys | None:
    """The member keys to reach ``address`` with (``None``: connect without CURVE).

    ``source`` is a credentials file, its content as a dict, the keys themselves, or
    ``None`` to look where :func:`default_path` says (no file there: no CURVE).

    Raises:
        ConfigError: the file named cannot be read, or its keys are malformed.
    """
    if isinstance(source, ClusterKeys):
        return source
    if source is None:
        source = default_path(address)
        if not source.exists():
            return None
    if not isinstance(source, dict):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the credentials file {source}: {e}") from None
    if not isinstance(source, dict) or "keys" not in source:
        raise ConfigError("credentials must be a mapping with 'keys' (tokenlake serve writes them)")
    keys = source["keys"]
    return None if keys is None else ClusterKeys.from_dict(keys)
