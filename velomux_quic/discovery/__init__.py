"""Discovery: how a node learns where the other nodes listen.

A backend publishes this node's :class:`PeerRecord` and tells it the others'; the
messenger's peer registry (:mod:`velomux_quic.messenger.peers`) takes what it says. Three
backends ship: a fixed list from the configuration (:class:`StaticPeers`), a directory of
record files shared by the processes of one host (:class:`DirectoryPeers`), and etcd
(:class:`EtcdPeers`, the ``etcd`` extra), which also pushes joins, moves and leaves as
they happen (:class:`PeerWatch`). Anything that can publish, withdraw and list records
fits :class:`PeerDiscovery`.

Modules: :mod:`.records` (the record), :mod:`.backend` (the protocols),
:mod:`.static`, :mod:`.directory`, :mod:`.etcd` (the backends), :mod:`.config`
(``[[peers]]`` and ``[discovery]``, and the backend they describe).
"""

from .backend import PeerDiscovery, PeerListener, PeerWatch
from .config import DISCOVERY_BACKENDS, DiscoveryConfig, PeerEntry
from .directory import PEER_DIRECTORY_MODE, DirectoryPeers
from .etcd import EtcdPeers
from .records import PEER_RECORD_MAX_BYTES, PeerRecord, peer_address
from .static import StaticPeers

__all__ = [
    "DISCOVERY_BACKENDS",
    "PEER_DIRECTORY_MODE",
    "PEER_RECORD_MAX_BYTES",
    "DirectoryPeers",
    "DiscoveryConfig",
    "EtcdPeers",
    "PeerDiscovery",
    "PeerEntry",
    "PeerListener",
    "PeerRecord",
    "PeerWatch",
    "StaticPeers",
    "peer_address",
]
