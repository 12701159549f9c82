"""The push half of discovery without a store: DiscoveryFeed's rules, and what EtcdPeers
and DiscoveryConfig refuse at construction (the live behaviour is in
tests/integration/test_etcd_discovery.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from velomux_quic import (
    ConfigurationError,
    DiscoveryConfig,
    EtcdPeers,
    InstanceId,
    PeerRecord,
    PeerRegistry,
    WorkerId,
)
from velomux_quic.discovery import PeerWatch
from velomux_quic.ids import new_instance_id
from velomux_quic.messenger.peers import DiscoveryFeed


def record(instance_id: InstanceId, port: int = 7000) -> PeerRecord:
    return PeerRecord(instance_id, ("127.0.0.1", port), updated_at=1.0)


def test_joins_moves_and_leaves_reach_the_registry() -> None:
    registry = PeerRegistry()
    moved: list[InstanceId] = []
    feed = DiscoveryFeed(registry, on_moved=moved.append)
    peer = new_instance_id()
    feed(record(peer), peer)
    assert registry.get(peer) == record(peer)
    feed(record(peer, 7001), peer)
    assert registry.get(peer) == record(peer, 7001)
    assert moved == [peer]
    feed(None, peer)
    assert peer not in registry
    assert feed.brought_in() == set()


def test_a_leave_removes_only_what_discovery_brought_in_and_nobody_replaced() -> None:
    static, replaced = new_instance_id(), new_instance_id()
    registry = PeerRegistry([record(static)])
    feed = DiscoveryFeed(registry)
    feed(record(static, 7100), static)  # discovery may move a static peer ...
    assert registry.get(static) == record(static, 7100)
    feed(None, static)  # ... but never remove it
    assert registry.get(static) == record(static, 7100)

    feed(record(replaced), replaced)
    registry.add(record(replaced, 7200))  # the application's own record now
    feed(None, replaced)
    assert registry.get(replaced) == record(replaced, 7200)


def test_the_own_record_and_colliding_worker_ids_stay_out() -> None:
    own, first, second = new_instance_id(), new_instance_id(), new_instance_id()
    registry = PeerRegistry(worker_id=lambda instance_id: WorkerId(7))  # all collide
    feed = DiscoveryFeed(registry, own=own)
    feed(record(own), own)
    assert own not in registry
    feed(record(first), first)
    feed(record(second), second)
    assert first in registry and second not in registry
    assert feed.collisions == 1


def test_etcd_peers_is_a_peer_watch_and_refuses_bad_settings(tmp_path: Path) -> None:
    pytest.importorskip("aetcd")
    assert isinstance(EtcdPeers(["127.0.0.1:2379"]), PeerWatch)
    bad = {
        "host:port": lambda: EtcdPeers(["localhost"]),
        "at least one": lambda: EtcdPeers([]),
        "absolute key path": lambda: EtcdPeers(prefix="velomux"),
        "whole number": lambda: EtcdPeers(lease_ttl=0),
        "close_timeout must be a positive number": lambda: EtcdPeers(close_timeout=0),
        "both cert_file and key_file": lambda: EtcdPeers(cert_file=tmp_path / "c.pem"),
        "CA file .*missing.pem: cannot read it": lambda: EtcdPeers(
            ca_file=tmp_path / "missing.pem"
        ),
    }
    for message, make in bad.items():
        with pytest.raises(ConfigurationError, match=message):
            make()


def test_without_aetcd_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aetcd", None)  # importing it raises ImportError
    with pytest.raises(ConfigurationError, match=r"pip install 'velomux-quic\[etcd\]'"):
        EtcdPeers()
    with pytest.raises(ConfigurationError, match="velomux-quic"):
        DiscoveryConfig(backend="etcd").backend_for()


def test_discovery_config_names_the_key_and_the_reason() -> None:
    assert DiscoveryConfig().backend_for() is None
    cases = {
        "backend must be one of": {"backend": "consul"},
        'directory: backend = "directory" needs': {"backend": "directory"},
        "directory is used only with": {"directory": "/tmp/x"},
        "etcd_endpoints must be a list": {"etcd_endpoints": ["a:1"]},
        "etcd_endpoints: 'a' is not host:port": {"etcd_endpoints": ("a",)},
        "etcd_prefix must be": {"etcd_prefix": "/"},
        "lease_ttl must be": {"lease_ttl": 2.5},
        "etcd_cert and etcd_key": {"etcd_key": "k.pem"},
    }
    for message, values in cases.items():
        with pytest.raises(ConfigurationError, match=message):
            DiscoveryConfig(**values)  # type: ignore[arg-type]
