"""What every ``tokenlake`` subcommand shares: the parser class, the help format, the
argument types and the error a command raises for a user's mistake.

The contract of the command line (tested in ``tests/test_cli.py``):

* a mistake in what the user asked for (a bad value, an unknown name, a number out of
  range, a missing file, a :class:`~tokenlake.core.errors.ConfigError` from the input)
  ends in one line on stderr, ``tokenlake: error: ...``, and exit code 2, never a
  traceback;
* every help shows the defaults; where a name is expected the valid names are listed.

Parse-time mistakes leave through :meth:`Parser.error` (``SystemExit(2)``, as argparse
does); mistakes found while a command runs are raised as :class:`UsageError` and turned
into the same line and exit code by :func:`tokenlake.tools.cli.main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from tokenlake.core.config import is_device

PROG = "tokenlake"
USAGE_EXIT = 2  # a mistake of the user's, whatever the subcommand


class UsageError(Exception):
    """A mistake in the user's request found while a command runs: one line, exit 2."""


def report(message: str) -> int:
    """Prints ``tokenlake: error: <message>`` as one line on stderr; returns exit code 2."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return USAGE_EXIT


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every option whose default means something.

    ``None`` (the help says what happens instead) and ``False`` (a flag) are left out.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and whose help shows defaults.

    Subparsers made with ``add_subparsers().add_parser`` are of this class too.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix(PROG).strip()
        report(f"{where}: {message}" if where else message)
        raise SystemExit(USAGE_EXIT)


# --------------------------------------------------------------------------- types


def _number(kind: type, text: str) -> float:
    try:
        return kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    if is_device(text):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def check_device(device: str, what: str, kv_dtype: str | None = None) -> None:
    """A :class:`UsageError` unless ``device`` (``cpu``, ``cuda``, ``cuda:N``) can serve:
    on a GPU a half ``kv_dtype`` (where the command takes one), and torch sees a CUDA GPU,
    and GPU ``N``. Loads torch for a CUDA device only."""
    if device == "cpu":
        return
    if kv_dtype == "float32":
        raise UsageError(f"{what}: --device {device} needs --kv-dtype bfloat16 or float16")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = f"sees {count} GPU(s)" if count else "sees no CUDA GPU"
        raise UsageError(f"{what}: --device {device}, but this torch ({torch.__version__}) {seen}")


def at_least(kind: type, low: float) -> Callable[[str], float]:
    """An argparse type: a ``kind`` (int or float) that is ``>= low``."""

    def parse(text: str) -> float:
        value = _number(kind, text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a ``kind`` (int or float) that is ``> 0``."""

    def parse(text: str) -> float:
        value = _number(kind, text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    value = _number(float, text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def share(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = _number(float, text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def port_range(text: str) -> tuple[int, int]:
    """An argparse type: ``FIRST-LAST`` or ``PORT`` -> ``(first, last)``, 1 <= first <= last <= 65535."""
    first, _, last = text.partition("-")
    try:
        ports = (int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST or PORT, got {text!r}") from None
    if not 1 <= ports[0] <= ports[1] <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected ports 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return ports


def output_file(text: str) -> str:
    """An argparse type: a file path whose folder exists (checked before any work starts)."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist")
    return text
