"""Type stubs of the compiled record path of the streaming layer (``_compiled.pyx``).

Each function has the signature of the pure-Python definition it twins (see
velomux_quic.recordpath)."""

from collections.abc import Awaitable
from typing import Any

def StreamAnchor__take_items(self: Any, items: list[Any], limit: int) -> None: ...
def StreamAnchor___anext__(self: Any) -> Awaitable[Any]: ...
