"""The package root is the public surface: ``__all__`` is the contract users import from."""

from __future__ import annotations

import inspect

import pytest

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
    "runtime_info",
    "RuntimeInfo",
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


def test_the_ways_to_open_a_node_share_one_declaration_of_their_options() -> None:
    """Node.start, Node.open and open_node take a NodeConfig or credentials and the same
    keywords, typed once (their settings are NodeConfig's fields: test_node_config.py);
    a keyword that is no option fails at the call, naming it."""
    annotations = set()
    for opener in (velomux_quic.Node.start, velomux_quic.Node.open, velomux_quic.open_node):
        parameters = list(inspect.signature(opener).parameters.values())
        assert [p.name for p in parameters] == ["credentials", "options"], opener
        assert parameters[1].kind is inspect.Parameter.VAR_KEYWORD
        annotations.add(parameters[1].annotation)
    assert len(annotations) == 1
    options: dict[str, object] = {"hots": "127.0.0.1"}
    for opener in (velomux_quic.open_node, velomux_quic.Node.open):
        with pytest.raises(velomux_quic.ConfigurationError, match="'hots', which is no option"):
            opener("certs/dev/node-a", **options)  # type: ignore[arg-type]


async def test_node_start_refuses_a_keyword_that_is_no_option_before_it_starts() -> None:
    options: dict[str, object] = {"prot": 7000}
    with pytest.raises(velomux_quic.ConfigurationError, match=r"'prot'.*the options are"):
        await velomux_quic.Node.start("certs/dev/node-a", **options)  # type: ignore[arg-type]
