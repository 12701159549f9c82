"""Header codecs: how a layer above the messenger gives one envelope header a typed value.

An envelope's headers are a small ``str -> str`` map (see :mod:`.envelope`). The messenger
carries them and reads none of them. A layer built on it (the mux, for one) that needs a
header of its own registers a :class:`HeaderCodec` with
:meth:`~velomux_quic.messenger.messenger.Messenger.register_header`: the codec names the
header and says how a value is written and read. Header names starting with ``_`` are
reserved for such codecs, as handler names starting with ``_`` are reserved for the layers'
own handlers, so an application's header can never be mistaken for one a layer reads.

The messenger only checks, on the send path and only when a message has headers, that a
``_`` header has a registered codec; what the value means stays with the layer that
registered it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import ConfigurationError

__all__ = ["RESERVED_PREFIX", "HeaderCodec"]

T = TypeVar("T")

RESERVED_PREFIX = "_"
"""Handler and header names with this prefix belong to the layers built on the messenger."""


@dataclass(frozen=True, slots=True)
class HeaderCodec(Generic[T]):
    """One reserved envelope header: its name and how its value is written and read.

    ``decode`` raises :class:`~velomux_quic.errors.MalformedEnvelope` for a value it
    cannot read: a header value comes from a peer.
    """

    name: str
    """The header's name; it must start with ``_`` (see the module docstring)."""
    encode: Callable[[T], str]
    """A value as the header's text."""
    decode: Callable[[str], T]
    """The header's text as a value; MalformedEnvelope when it is not one."""

    def __post_init__(self) -> None:
        if not self.name.startswith(RESERVED_PREFIX) or len(self.name) < 2:
            raise ConfigurationError(
                f"a header codec names a reserved header ('_' and a name), got {self.name!r}"
            )

    def write(self, value: T) -> dict[str, str]:
        """The headers of a message that carries ``value`` in this header alone."""
        return {self.name: self.encode(value)}

    def read(self, headers: Mapping[str, str] | None) -> T | None:
        """This header's value in ``headers``, or None when the message does not carry it.

        Raises MalformedEnvelope when the header is there but unreadable.
        """
        if not headers:
            return None
        text = headers.get(self.name)
        return None if text is None else self.decode(text)
