"""The package root is the public surface: ``__all__`` is the contract users import from."""

from __future__ import annotations

import inspect

import velomux_quic
from velomux_quic import errors

# The names an application uses besides the exceptions; changing this set changes the API.
SURFACE = {
    "open_node",
    "Node",
    "NodeSnapshot",
    "OpsConfig",
    "ReadinessReport",
    "StreamAnchor",
    "MpscAnchor",
    "MpscItem",
    "MpscEvent",
    "StreamSender",
    "Retired",
    "PassOutcome",
    "StreamOpenTicket",
    "MESSENGER_MUX_KEY",
    "PER_STREAM_KEY",
    "InstanceId",
    "WorkerId",
    "StreamAnchorHandle",
    "MuxConfig",
    "FlushPolicy",
    "AutoFlush",
    "Manual",
    "TransportConfig",
    "MessengerConfig",
    "StreamingConfig",
    "NodeConfig",
    "PeerEntry",
    "NodeCredentials",
    "PeerRecord",
    "PeerRegistry",
    "PeerDiscovery",
    "DirectoryPeers",
    "StaticPeers",
    "EtcdPeers",
    "DiscoveryConfig",
    "Context",
    "Dispatch",
    "ensure_dev_cluster",
    "__version__",
}


def test_all_is_exactly_the_surface_and_every_exception() -> None:
    assert set(velomux_quic.__all__) == SURFACE | set(errors.__all__)
    assert len(velomux_quic.__all__) == len(set(velomux_quic.__all__)), "a name listed twice"


def test_every_exported_name_resolves_to_the_object_its_module_defines() -> None:
    for name in velomux_quic.__all__:
        assert hasattr(velomux_quic, name), name
    for name in errors.__all__:
        assert getattr(velomux_quic, name) is getattr(errors, name), name


def test_every_exception_of_the_tree_is_exported_and_derives_from_the_root() -> None:
    exported = {getattr(velomux_quic, name) for name in velomux_quic.__all__}
    classes = [obj for obj in vars(errors).values() if inspect.isclass(obj)]
    for cls in classes:
        if issubclass(cls, BaseException):
            assert cls in exported, cls.__name__
            assert issubclass(cls, velomux_quic.VelomuxError), cls.__name__


def test_one_channel_closed_for_the_transport_and_the_sender() -> None:
    assert issubclass(velomux_quic.ChannelClosed, velomux_quic.TransportError)
    assert issubclass(velomux_quic.ChannelClosed, velomux_quic.SendError)


def test_every_public_method_of_node_has_a_docstring() -> None:
    undocumented = [
        name
        for name, member in vars(velomux_quic.Node).items()
        if not name.startswith("_")
        and (inspect.isfunction(member) or isinstance(member, (classmethod, property)))
        and not inspect.getdoc(getattr(velomux_quic.Node, name))
    ]
    assert undocumented == []
    assert inspect.getdoc(velomux_quic.open_node)


def test_the_keyed_twins_are_gone() -> None:
    for name in ("attach_anchor_keyed", "attach_mpsc_anchor_keyed", "prebind_anchor_keyed"):
        assert not hasattr(velomux_quic.Node, name), name
    for name in ("attach_anchor", "attach_mpsc_anchor", "prebind_anchor"):
        assert "key" in inspect.signature(getattr(velomux_quic.Node, name)).parameters
