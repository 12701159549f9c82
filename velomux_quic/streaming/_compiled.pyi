"""Type stubs of the compiled record path of the streaming layer (``_compiled.pyx``).

Each function has the signature of the pure-Python definition it twins (see
velomux_quic.recordpath)."""

from collections.abc import Awaitable, Iterable
from typing import Any

from ..errors import ChannelClosed, SerializationError
from .channels import ProducerChannel
from .inbox import Feed
from .sender import SenderState, StreamSender

class SenderStateFields:
    channel: ProducerChannel
    terminal_sent: bool

class StreamSenderFields:
    _state: SenderState

class StagingChannel: ...

def _stage_pass(
    pairs: Iterable[tuple[StreamSender, Any]],
    failed: dict[int, ChannelClosed | SerializationError],
    left: list[tuple[int, SenderState, bytes]],
) -> int: ...
def StreamAnchor__take_items(self: Any, items: list[Any], limit: int) -> None: ...
def encode_item(item: object) -> bytes: ...
async def StreamSender_send(self: Any, item: Any, *, timeout: float | None = None) -> None: ...
def StreamAnchor___anext__(self: Any) -> Awaitable[Any]: ...
