"""A node on qh3 runs with aioquic impossible to import: no transport module needs it.

The check runs in a child interpreter whose import system refuses every ``aioquic``
module, so nothing imported earlier in the test session can hide an import. Two qh3
nodes there dial each other through a Retry (the endpoint's own packets), exchange a
frame and close, and the child reports that no aioquic module was ever loaded.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("qh3") is None, reason="the qh3 extra is not installed"
)

CHILD = textwrap.dedent(
    """
    import asyncio
    import importlib.abc
    import sys


    class RefuseAioquic(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "aioquic" or name.startswith("aioquic."):
                raise ImportError(f"{name} may not be imported here")
            return None


    sys.meta_path.insert(0, RefuseAioquic())

    from velomux_quic.ids import new_instance_id
    from velomux_quic.security.certs import CertificateAuthority, issue_node_certificate
    from velomux_quic.transport.config import TransportConfig
    from velomux_quic.transport.endpoint import QuicEndpoint, TransportHandler


    class Received(TransportHandler):
        def __init__(self):
            self.frame = asyncio.Event()

        def frame_received(self, peer, lane, body):
            if body == b"hello":
                self.frame.set()


    async def main():
        ca = CertificateAuthority.create("a cluster CA")
        dialer_creds = issue_node_certificate(ca, new_instance_id(), name="dialer")
        acceptor_creds = issue_node_certificate(ca, new_instance_id(), name="acceptor")
        config = TransportConfig(engine="qh3", retry_threshold=0)  # every dial is retried
        handler = Received()
        async with (
            await QuicEndpoint.start(dialer_creds, config=config) as dialer,
            await QuicEndpoint.start(acceptor_creds, config=config, handler=handler) as acceptor,
        ):
            dialer.register_peer(acceptor.instance_id, acceptor.address)
            await asyncio.wait_for(dialer.connect(acceptor.instance_id), 10)
            dialer.send(acceptor.instance_id, 0, b"hello")
            await asyncio.wait_for(handler.frame.wait(), 10)
            assert acceptor.stats.rejections["handshake_retry"] >= 1
        loaded = sorted(name for name in sys.modules if name.split(".")[0] == "aioquic")
        print("aioquic modules loaded:", loaded)
        assert loaded == []


    asyncio.run(main())
    """
)


def test_a_qh3_node_imports_nothing_of_aioquic() -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "aioquic modules loaded: []" in child.stdout
