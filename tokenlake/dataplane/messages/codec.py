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

The reader of each type is made once from its annotations and kept, as is each
dataclass's list of fields: a decode step's plans are read in about a third of the time
that looking them up for every value took (about 110 against 300 µs here).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from tokenlake.dataplane.messages.base import Fields
from tokenlake.dataplane.tensor_frames import WireError, short

#: Values to_plain passes through unchanged (checked by exact type first: most values are).
_NATIVE = frozenset({int, float, str, bytes, bool, type(None)})


def to_plain(value: Any) -> Any:
    """``value`` as msgpack-native data (see the module's rules)."""
    kind = type(value)
    if kind in _NATIVE:
        return value
    names = _field_names(kind)
    if names is not None:
        return {name: to_plain(getattr(value, name)) for name in names}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return [[to_plain(k), to_plain(v)] for k, v in value.items()]
    return value


@functools.cache
def _field_names(kind: type) -> tuple[str, ...] | None:
    """The field names of dataclass ``kind`` (None for any other type)."""
    if not dataclasses.is_dataclass(kind):
        return None
    return tuple(f.name for f in dataclasses.fields(kind))


Reader = Callable[[Any, Fields, str], Any]


def from_plain(tp: Any, value: Any, f: Fields, path: str) -> Any:
    """``value`` read as type ``tp``; :class:`WireError` (via ``f.error``) naming ``path``
    when it does not fit."""
    return _reader(tp)(value, f, path)


@functools.cache
def _reader(tp: Any) -> Reader:
    """The function that reads a value as ``tp``, made once per type (reading a plan
    then costs no look at its annotations)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"codec: unsupported union {tp}")  # a programming error, not input
        inner, nullable = _reader(rest[0]), type(None) in args
        return lambda value, f, path: None if value is None and nullable else inner(value, f, path)
    if origin is Literal:
        return functools.partial(_literal, args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return functools.partial(_tuple_of, _reader(args[0]))
        return functools.partial(_tuple_fixed, tuple(_reader(a) for a in args))
    if origin in (Mapping, dict) or tp is dict:
        key_tp, value_tp = args or (Any, Any)
        return functools.partial(_mapping, _reader(key_tp), _reader(value_tp))
    if dataclasses.is_dataclass(tp):
        return _dataclass_reader(tp)
    return _leaf_reader(tp)


def _literal(args: tuple, value: Any, f: Fields, path: str) -> Any:
    if not any(value == a and type(value) is type(a) for a in args):
        raise f.error(path, f"must be one of {list(args)}, got {short(value)}")
    return value


def _tuple_of(item: Reader, value: Any, f: Fields, path: str) -> tuple:
    return tuple(item(v, f, f"{path}[{i}]") for i, v in enumerate(f.as_list(value, path)))


def _tuple_fixed(items: tuple[Reader, ...], value: Any, f: Fields, path: str) -> tuple:
    values = f.as_list(value, path, len(items))
    return tuple(r(v, f, f"{path}[{i}]") for i, (r, v) in enumerate(zip(items, values)))


def _mapping(key: Reader, val: Reader, value: Any, f: Fields, path: str) -> dict:
    pairs = f.as_list(value, path)
    return {key(f.as_list(p, f"{path}[{i}]", 2)[0], f, f"{path}[{i}][0]"): val(p[1], f, f"{path}[{i}][1]")
            for i, p in enumerate(pairs)}


def _leaf_reader(tp: Any) -> Reader:
    if tp is Any:
        return lambda value, f, path: value
    if tp is int:
        return lambda value, f, path: f.as_int(value, path)
    if tp is float:
        return lambda value, f, path: f.as_float(value, path)
    if tp in (str, bytes, bool):
        def exact(value: Any, f: Fields, path: str) -> Any:
            if type(value) is not tp:
                raise f.error(path, f"must be a {tp.__name__}, got {short(value)}")
            return value
        return exact
    raise TypeError(f"codec: unsupported type {tp!r}")  # a programming error, not input


def _dataclass_reader(cls: type) -> Reader:
    """Reads a map of ``cls``'s fields: each by its annotation; a missing field takes its
    default or is refused; the dataclass's own checks refuse what they refuse."""
    hints = typing.get_type_hints(cls)
    fields = [(fd.name, fd.default is not dataclasses.MISSING or fd.default_factory is not dataclasses.MISSING)
              for fd in dataclasses.fields(cls) if fd.init]
    readers = {name: _reader(hints[name]) for name, _ in fields}

    def read(value: Any, f: Fields, path: str) -> Any:
        if not isinstance(value, dict):
            raise f.error(path, f"must be a map ({cls.__name__}), got {short(value)}")
        kwargs = {}
        for name, has_default in fields:
            if name not in value:
                if has_default:
                    continue
                raise f.error(f"{path}.{name}", "is missing")
            kwargs[name] = readers[name](value[name], f, f"{path}.{name}")
        try:
            return cls(**kwargs)
        except WireError:
            raise
        except Exception as e:  # the dataclass's own checks (ConfigError, SharedMemoryError, ...)
            raise f.error(path, f"is not a valid {cls.__name__}: {e}") from None

    return read
