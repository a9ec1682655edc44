"""The base of the typed wire messages, and the reader that validates a body.

Every :class:`~tokenlake.dataplane.wire.Kind` has one frozen dataclass, a subclass of
:class:`WireMessage`, that owns its body's schema:

* ``encode(msg_id)`` gives its frames: one :func:`~tokenlake.dataplane.wire.encode`,
  the only flattening, done at the socket;
* ``from_wire(fields)`` reads a decoded body into the dataclass (nested plan items
  become typed items too) and raises :class:`WireError` naming the field on anything
  malformed.

Decoding checks types and structure only. Whether a slot, layer or row range fits the
receiving engine (its slab, its buffers) is that engine's check and a ``PlanError``, as
the same numbers are fine on another engine. Receivers ignore body fields they do not
know (``docs/protocol.md``, *Versioning*). Messages built in code are not re-checked:
their fields come from already validated plans.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch

from tokenlake.dataplane.tensor_frames import WireError, short
from tokenlake.dataplane.wire import Kind, encode

M = TypeVar("M", bound="WireMessage")

#: kind -> its message class; filled as the classes are defined.
TYPES: dict[Kind, type[WireMessage]] = {}


class WireMessage:
    """One message kind's body and tensors. Subclasses are frozen dataclasses that set
    ``KIND`` and override :meth:`body`, :meth:`tensors` and :meth:`from_wire` (the
    defaults fit an empty body without tensors)."""

    KIND: ClassVar[Kind]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.KIND in TYPES:
            raise TypeError(f"{cls.__name__}: {cls.KIND.name} already has {TYPES[cls.KIND].__name__}")
        TYPES[cls.KIND] = cls

    def body(self) -> dict:
        """The msgpack-native body (the ``b`` of the header)."""
        return {}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor frames, in order (C-contiguous CPU tensors; sent without copying)."""
        return ()

    @classmethod
    def from_wire(cls: type[M], fields: Fields) -> M:
        """Reads a decoded body; raises :class:`WireError` naming the bad field."""
        fields.tensors(0)
        return cls()

    def encode(self, msg_id: int) -> list:
        """The message's frames, ready for :func:`tokenlake.dataplane.sockets.send_frames`."""
        return encode(self.KIND, msg_id, self.body(), self.tensors())


class Fields:
    """The body and tensors of one decoded message of ``kind``, read field by field.

    Every accessor checks the value's type (ints are ints, never bools or floats) and
    raises :class:`WireError` with ``field`` set to the path at fault, and a text that
    starts with the kind's name and the path: ``"QUERY: field 'layer' must be an int,
    got '3'"``.
    """

    __slots__ = ("kind", "body", "_tensors")

    def __init__(self, kind: Kind, body: dict, tensors: tuple = ()) -> None:
        self.kind, self.body, self._tensors = kind, body, tensors

    def error(self, path: str, problem: str) -> WireError:
        err = WireError(f"{self.kind.name}: field {path!r} {problem}")
        err.field = path
        return err

    def get(self, name: str) -> Any:
        """The raw value of a required field."""
        try:
            return self.body[name]
        except KeyError:
            raise self.error(name, "is missing") from None

    def int(self, name: str, default: int | None = None) -> int:
        """A required int field (or ``default`` when absent and a default is given)."""
        if default is not None and name not in self.body:
            return default
        return self.as_int(self.get(name), name)

    def bool(self, name: str, default: bool | None = None) -> bool:
        """A required bool field (or ``default`` when absent and a default is given)."""
        return self._typed(name, default, bool, "a bool")

    def float(self, name: str) -> float:
        return self.as_float(self.get(name), name)

    def str(self, name: str) -> str:
        return self._typed(name, None, str, "a str")

    def bin(self, name: str, default: bytes | None = None) -> bytes:
        """A required bytes field (or ``default`` when absent and a default is given)."""
        return self._typed(name, default, bytes, "bytes")

    def _typed(self, name: str, default: Any, kind: type, what: str) -> Any:
        """Field ``name``, an instance of ``kind`` (``what`` names it in the error), or
        ``default`` when absent and a default is given."""
        if default is not None and name not in self.body:
            return default
        value = self.get(name)
        if not isinstance(value, kind):
            raise self.error(name, f"must be {what}, got {short(value)}")
        return value

    def list(self, name: str, default: list | None = None) -> list:
        """A required list field (or ``default`` when absent and a default is given)."""
        if default is not None and name not in self.body:
            return default
        return self.as_list(self.get(name), name)

    def as_int(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, f"must be an int, got {short(value)}")
        return value

    def as_float(self, value: Any, path: str) -> float:
        """A number (an int or a float, never a bool), as a float."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(path, f"must be a number, got {short(value)}")
        return float(value)

    def as_ints(self, value: Any, path: str) -> tuple[int, ...]:
        """A list of ints, as a tuple."""
        return tuple(self.as_int(v, f"{path}[{i}]") for i, v in enumerate(self.as_list(value, path)))

    def as_list(self, value: Any, path: str, length: int | None = None) -> list:
        """A list (of exactly ``length`` entries when given)."""
        if not isinstance(value, list):
            raise self.error(path, f"must be a list, got {short(value)}")
        if length is not None and len(value) != length:
            raise self.error(path, f"must have {length} entries, got {short(value)}")
        return value

    def tensors(self, count: int, what: str = "") -> tuple[torch.Tensor, ...]:
        """The message's tensors, of which there must be exactly ``count``."""
        if len(self._tensors) != count:
            err = WireError(f"{self.kind.name}: needs {count} tensor(s){what and ' (' + what + ')'}, "
                            f"got {len(self._tensors)}")
            err.field = "tensors"
            raise err
        return self._tensors
