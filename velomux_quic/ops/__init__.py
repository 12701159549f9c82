"""A node's operations endpoints: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP.

:meth:`velomux_quic.Node.serve_ops` serves them (off by default in the library; ``velomux
node`` turns them on with ``--ops``). Modules: :mod:`.server` (the small HTTP/1.1
listener), :mod:`.readiness` (what ``/readyz`` answers), :mod:`.config` (their bounds).
"""

from .config import OpsConfig
from .readiness import PeerReadiness, ReadinessReport
from .server import OpsServer

__all__ = ["OpsConfig", "OpsServer", "PeerReadiness", "ReadinessReport"]
