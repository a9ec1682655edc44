"""Exact msgpack-native encoding of the core's frozen dataclasses (plans, batches,
matches, statistics, specs), read back by their type annotations.

    plain = to_plain(plans)                       # dicts, lists, ints, str, bytes, None
    plans = from_plain(Plans, plain, fields, "plans")

Written once for every dataclass the control-plane server's messages carry
(:mod:`tokenlake.dataplane.messages.service`): a dataclass becomes a str-keyed map of its
fields, a tuple or list a list, a mapping a list of ``[key, value]`` pairs (msgpack map
keys on the wire are strings only), and anything else must already be msgpack-native.
Reading follows the annotations: ``int``, ``float``, ``str``, ``bytes``, ``bool``,
``X | None``, ``Literal[...]``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``Mapping[K, V]`` and
nested dataclasses. A value of the wrong shape, or one the dataclass's own checks refuse,
raises :class:`~tokenlake.dataplane.tensor_frames.WireError` naming its path; fields the
reader does not know are ignored (docs/protocol.md, *Versioning*).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from tokenlake.dataplane.messages.base import Fields
from tokenlake.dataplane.tensor_frames import WireError, short

T = TypeVar("T")


def to_plain(value: Any) -> Any:
    """``value`` as msgpack-native data (see the module's rules)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return [[to_plain(k), to_plain(v)] for k, v in value.items()]
    return value


def from_plain(tp: Any, value: Any, f: Fields, path: str) -> Any:
    """``value`` read as type ``tp``; :class:`WireError` (via ``f.error``) naming ``path``
    when it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"codec: unsupported union {tp}")  # a programming error, not input
        return from_plain(rest[0], value, f, path)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise f.error(path, f"must be one of {list(args)}, got {short(value)}")
        return value
    if origin is tuple:
        return _tuple(args, value, f, path)
    if origin in (Mapping, dict) or tp is dict:
        key_tp, value_tp = args or (Any, Any)
        pairs = f.as_list(value, path)
        return {from_plain(key_tp, f.as_list(p, f"{path}[{i}]", 2)[0], f, f"{path}[{i}][0]"):
                from_plain(value_tp, p[1], f, f"{path}[{i}][1]") for i, p in enumerate(pairs)}
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, f, path)
    return _leaf(tp, value, f, path)


def _tuple(args: tuple, value: Any, f: Fields, path: str) -> tuple:
    if len(args) == 2 and args[1] is Ellipsis:
        items = f.as_list(value, path)
        return tuple(from_plain(args[0], v, f, f"{path}[{i}]") for i, v in enumerate(items))
    items = f.as_list(value, path, len(args))
    return tuple(from_plain(a, v, f, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, items)))


def _leaf(tp: Any, value: Any, f: Fields, path: str) -> Any:
    if tp is Any:
        return value
    if tp is int:
        return f.as_int(value, path)
    if tp is float:
        return f.as_float(value, path)
    if tp in (str, bytes, bool):
        if type(value) is not tp:
            raise f.error(path, f"must be a {tp.__name__}, got {short(value)}")
        return value
    raise TypeError(f"codec: unsupported type {tp!r}")  # a programming error, not input


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass(cls: type[T], value: Any, f: Fields, path: str) -> T:
    if not isinstance(value, dict):
        raise f.error(path, f"must be a map ({cls.__name__}), got {short(value)}")
    hints, kwargs = _hints(cls), {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name not in value:
            has_default = (field.default is not dataclasses.MISSING
                           or field.default_factory is not dataclasses.MISSING)
            if has_default:
                continue
            raise f.error(f"{path}.{field.name}", "is missing")
        kwargs[field.name] = from_plain(hints[field.name], value[field.name], f, f"{path}.{field.name}")
    try:
        return cls(**kwargs)
    except WireError:
        raise
    except Exception as e:  # the dataclass's own checks (ConfigError, SharedMemoryError, ...)
        raise f.error(path, f"is not a valid {cls.__name__}: {e}") from None
