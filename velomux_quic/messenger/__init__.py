"""The messenger: active messages between nodes over the QUIC transport.

Handlers by name (inline, ordered per (sender, lane), or spawned), fire-and-forget,
acknowledged and unary calls with typed remote errors, rendezvous for large payloads,
the peer registry that maps identities to addresses, and the generic hooks the layers
above plug into (reserved handler names, header codecs).

Modules: :mod:`.messenger` (the :class:`Messenger`: sending, receiving, dispatch),
:mod:`.rendezvous` (its collaborator for staged payloads) and :mod:`.staging` (the store
of payloads held for peers), :mod:`.registry` (handlers and the :class:`Context`),
:mod:`.dispatch` (ordered queues), :mod:`.calls` (calls waiting for answers),
:mod:`.envelope` and :mod:`.contents` (the wire format), :mod:`.headers` (header codecs),
:mod:`.peers` (the peer registry, which discovery fills: :mod:`velomux_quic.discovery`),
:mod:`.config`, :mod:`.metrics`, :mod:`.snapshot`. Its errors are in
:mod:`velomux_quic.errors`, with every other error of the library.
"""

from .config import MessengerConfig
from .envelope import Kind
from .headers import HeaderCodec
from .messenger import Messenger, StagedRefusal
from .peers import PeerRegistry
from .registry import Context, Dispatch, Handler, HandlerResult
from .snapshot import MessengerSnapshot

__all__ = [
    "Context",
    "Dispatch",
    "Handler",
    "HandlerResult",
    "HeaderCodec",
    "Kind",
    "Messenger",
    "MessengerConfig",
    "MessengerSnapshot",
    "PeerRegistry",
    "StagedRefusal",
]
