"""NodeConfig: TOML loading, environment overrides, errors that name file and key, the sample."""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from velomux_quic import (
    ConfigurationError,
    DiscoveryConfig,
    Manual,
    MessengerConfig,
    MuxConfig,
    NodeConfig,
    NodeCredentials,
    PeerEntry,
    StreamingConfig,
    TransportConfig,
    open_node,
)
from velomux_quic.ids import new_instance_id
from velomux_quic.mux.config import AutoFlush, mux_disabled_by_env

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def _error(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigurationError) as caught:
        NodeConfig.from_toml(path, environ=environ or {})
    return str(caught.value)


def test_the_sample_loads_to_the_defaults() -> None:
    assert NodeConfig.from_toml(SAMPLE, environ={}) == NodeConfig()


def _section(text: str, name: str) -> str:
    match = re.search(rf"^\[{re.escape(name)}\][^\n]*\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert match is not None, f"the sample has no [{name}] section"
    return match.group(1)


def _documents(section: str, key: str) -> bool:
    return re.search(rf"^#? ?{re.escape(key)} =", section, re.M) is not None


@pytest.mark.parametrize(
    ("section", "config_class"),
    [
        ("transport", TransportConfig),
        ("messenger", MessengerConfig),
        ("streaming", StreamingConfig),
        ("mux", MuxConfig),
        ("mux.flush_policy", AutoFlush),
        ("discovery", DiscoveryConfig),
    ],
)
def test_the_sample_documents_every_field_of_every_layer(
    section: str, config_class: type[object]
) -> None:
    body = _section(SAMPLE.read_text(), section)
    fields = [f.name for f in dataclasses.fields(config_class) if f.name != "flush_policy"]  # type: ignore[arg-type]
    missing = [name for name in fields if not _documents(body, name)]
    assert missing == []


def test_the_sample_documents_every_node_key_and_a_peer() -> None:
    text = SAMPLE.read_text()
    node = _section(text, "node")
    layers = {"transport", "messenger", "streaming", "mux", "peers", "discovery"}
    own = [f.name for f in dataclasses.fields(NodeConfig) if f.name not in layers]
    assert [name for name in own if not _documents(node, name)] == []
    assert "# [[peers]]" in text
    for key in (f.name for f in dataclasses.fields(PeerEntry)):
        assert _documents(node, key), key


def test_keys_and_environment_overrides_are_applied(tmp_path: Path) -> None:
    peer = new_instance_id()
    path = _write(
        tmp_path,
        f"""
[node]
credentials = "creds"
port = 7000
name = "engine-0"

[[peers]]
instance_id = "{peer}"
address = "10.0.0.2:7001"
name = "frontend-0"

[transport]
lanes = 2
idle_timeout = 20   # an integer is a number

[mux]
initial_credit = 64

[mux.flush_policy]
kind = "manual"
""",
    )
    environ = {
        "VELOMUX_TRANSPORT_LANES": "4",
        "VELOMUX_NODE_PORT": "7100",
        "VELOMUX_MUX_MUX_ONLY": "true",
        "VELOMUX_TRANSPORT_MAX_PARTIAL_FRAME_BYTES": "33554432",
        "VELOMUX_STREAMING_ATTACH_TIMEOUT": "2.5",
        "VELOMUX_NO_UVLOOP": "1",  # not a section's: left to whoever reads it
    }
    config = NodeConfig.from_toml(path, environ=environ)
    assert (config.credentials, config.port, config.name) == ("creds", 7100, "engine-0")
    assert config.transport.lanes == 4
    assert config.transport.idle_timeout == 20.0
    assert config.transport.max_partial_frame_bytes == 32 << 20
    assert config.streaming.attach_timeout == 2.5
    assert config.mux.initial_credit == 64 and config.mux.mux_only is True
    assert config.mux.flush_policy == Manual()
    [record] = config.peer_records()
    assert (record.instance_id, record.address, record.name) == (
        peer,
        ("10.0.0.2", 7001),
        "frontend-0",
    )


def test_an_unknown_key_names_the_file_the_key_and_the_known_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "[transport]\nlane = 2\n")
    message = _error(path)
    assert str(path) in message and "transport.lane" in message
    assert "unknown key" in message and "lanes" in message


def test_an_unknown_section_is_named(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "[tranport]\nlanes = 2\n"))
    assert "[tranport]" in message and "unknown section" in message


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('[transport]\nlanes = "four"\n', "transport.lanes", "must be an integer"),
        ("[transport]\nlanes = true\n", "transport.lanes", "boolean"),
        ("[mux]\nenabled = 1\n", "mux.enabled", "true or false"),
        ("[node]\nport = 70000\n", "node.port", "65535"),
        ("[mux]\ninitial_credit = 0\n", "mux.initial_credit", "positive"),
        ("[streaming]\nanchor_capacity = 0\n", "streaming.anchor_capacity", ">= 1"),
        ("[transport]\nlanes = 17\n", "transport.lanes", "16"),
        (
            '[transport]\nloopback_datagram_size = "big"\n',
            "transport.loopback_datagram_size",
            '"auto"',
        ),
        ('[mux.flush_policy]\nkind = "sometimes"\n', "mux.flush_policy.kind", "auto"),
        (
            "[mux.flush_policy]\non_admission = false\n",
            "mux.flush_policy",
            "max_linger",
        ),
        ('[[peers]]\naddress = "10.0.0.2:1"\n', "peers[0].instance_id", "missing"),
        (
            '[[peers]]\ninstance_id = "not-a-uuid"\naddress = "h:1"\n',
            "peers[0]",
            "UUID",
        ),
    ],
)
def test_a_bad_value_names_the_file_the_key_and_the_reason(
    tmp_path: Path, text: str, key: str, reason: str
) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert str(path) in message
    assert key in message
    assert reason in message


@pytest.mark.parametrize(
    ("text", "environ", "size"),
    [
        ("", {}, "auto"),
        ("[transport]\nloopback_datagram_size = 4096\n", {}, 4096),
        ('[transport]\nloopback_datagram_size = "auto"\n', {}, "auto"),
        ("", {"VELOMUX_TRANSPORT_LOOPBACK_DATAGRAM_SIZE": "8192"}, 8192),
        ("", {"VELOMUX_TRANSPORT_LOOPBACK_DATAGRAM_SIZE": "auto"}, "auto"),
        ("", {"VELOMUX_TRANSPORT_LOOPBACK_DATAGRAM_SIZE": "none"}, None),
    ],
)
def test_the_loopback_size_is_a_size_auto_or_none_from_file_or_environment(
    tmp_path: Path, text: str, environ: dict[str, str], size: object
) -> None:
    config = NodeConfig.from_toml(_write(tmp_path, text), environ=environ)
    assert config.transport.loopback_datagram_size == size


def test_a_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, "")
    message = _error(path, {"VELOMUX_TRANSPORT_LANES": "many"})
    assert "VELOMUX_TRANSPORT_LANES" in message and "integer" in message
    message = _error(path, {"VELOMUX_TRANSPORT_LANES": "40"})
    assert "VELOMUX_TRANSPORT_LANES" in message and "16" in message
    message = _error(path, {"VELOMUX_TRANSPORT_LANE": "4"})
    assert "VELOMUX_TRANSPORT_LANE:" in message and "no such key" in message
    assert "lanes" in message


def test_the_mux_switch_is_enabled_by_the_rule_and_the_old_variable_warns(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path, "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The project's switch is the setting: in the environment by the one rule.
        assert NodeConfig.load(path, environ={"VELOMUX_MUX_ENABLED": "false"}).mux.enabled is False
        assert NodeConfig.load(path, environ={}).mux.enabled is True
        # The chapter's variable is read where a node is built, without a warning.
        assert mux_disabled_by_env({"VELO_MESSENGER_MUX_DISABLE": "yes"})
        assert not mux_disabled_by_env({"VELO_MESSENGER_MUX_DISABLE": "2"})  # stray: still on
        assert not mux_disabled_by_env({})
    # A stray value of the switch is an error, never a silent "off".
    message = _error(path, {"VELOMUX_MUX_ENABLED": "2"})
    assert "VELOMUX_MUX_ENABLED" in message and "true or false" in message
    # The old name still applies for a release, with a warning naming what replaces it and
    # pointing at the line that loaded the configuration; the new name wins over it.
    with pytest.warns(
        DeprecationWarning, match="VELOMUX_MUX_DISABLE.*VELOMUX_MUX_ENABLED=false"
    ) as seen:
        config = NodeConfig.from_toml(path, environ={"VELOMUX_MUX_DISABLE": "1"})
    assert config.mux.enabled is False
    assert [warning.filename for warning in seen] == [__file__]
    with pytest.warns(DeprecationWarning, match="VELO_MESSENGER_MUX_DISABLE=1"):
        config = NodeConfig.load(
            path, environ={"VELOMUX_MUX_DISABLE": "1", "VELOMUX_MUX_ENABLED": "true"}
        )
    assert config.mux.enabled is True


def test_keywords_beat_the_environment_which_beats_the_file_which_beats_the_defaults(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        """
[node]
port = 7000
name = "from-file"
host = "10.0.0.1"

[transport]
lanes = 2
idle_timeout = 20
""",
    )
    environ = {"VELOMUX_NODE_PORT": "7100", "VELOMUX_NODE_HOST": "10.0.0.2",
               "VELOMUX_TRANSPORT_LANES": "4"}  # fmt: skip
    config = NodeConfig.load(path, environ=environ, port=7200)
    assert config.port == 7200  # keyword over environment over file
    assert config.host == "10.0.0.2"  # environment over file
    assert config.name == "from-file"  # file over default
    assert config.transport.lanes == 4 and config.transport.idle_timeout == 20.0
    assert config.messenger == MessengerConfig()  # default
    # A keyword sets the whole value it names: a layer's config replaces the file's and
    # the environment's keys of that section.
    config = NodeConfig.load(path, environ=environ, transport=TransportConfig(lanes=8))
    assert config.transport == TransportConfig(lanes=8)
    # No file: the environment over the defaults; no environment given: os.environ.
    assert NodeConfig.load(environ=environ).port == 7100
    assert NodeConfig.load(environ={}) == NodeConfig()
    # from_toml is load without keywords; override is the keywords' step alone.
    assert NodeConfig.from_toml(path, environ=environ) == NodeConfig.load(path, environ=environ)
    assert NodeConfig(port=1).override(port=2, name="x") == NodeConfig(port=2, name="x")


def test_a_keyword_that_is_no_setting_names_the_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="'prot': no such setting") as caught:
        NodeConfig.load(environ={}, prot=7000)
    assert "port" in str(caught.value) and "NodeConfig" in str(caught.value)
    with pytest.raises(ConfigurationError, match="port must be 0 to 65535"):
        NodeConfig.load(environ={}, port=70000)


def test_node_options_is_a_deprecated_name_of_the_keywords() -> None:
    import velomux_quic

    with pytest.warns(DeprecationWarning, match="NodeConfig") as seen:
        options = velomux_quic.NodeOptions
        from velomux_quic.node import NodeOptions
    assert NodeOptions is options
    assert [warning.filename for warning in seen] == [__file__, __file__]
    hints = typing.get_type_hints(velomux_quic.open_node, include_extras=True)
    (keywords,) = typing.get_args(hints["options"])
    assert options is keywords
    # The keywords that are settings are NodeConfig's fields, of the same types (or None:
    # not given); the rest are objects of the process, not settings.
    fields = typing.get_type_hints(NodeConfig)
    own = typing.get_type_hints(keywords)
    settings = set(own) - {"registry", "peers", "discovery", "publish"}
    assert settings == {"host", "port", "name", "transport", "messenger", "streaming", "mux"}
    for key in settings:
        assert set(typing.get_args(own[key]) or (own[key],)) - {type(None)} == {fields[key]}, key


def test_a_missing_or_broken_file_is_a_configuration_error(tmp_path: Path) -> None:
    assert "no such configuration file" in _error(tmp_path / "absent.toml")
    assert "not valid TOML" in _error(_write(tmp_path, "[transport\n"))


def test_node_config_validates_when_built_in_code() -> None:
    with pytest.raises(ConfigurationError, match="port"):
        NodeConfig(port=-1)
    with pytest.raises(ConfigurationError, match="peers\\[0\\]"):
        NodeConfig(peers=(PeerEntry(str(new_instance_id()), "no-port"),))


async def test_open_node_takes_a_node_config(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    directory = make_credentials("configured").save(tmp_path / "creds")
    config = NodeConfig(
        credentials=str(directory),
        name="from-config",
        transport=TransportConfig(lanes=3),
        mux=MuxConfig(enabled=False),
    )
    async with open_node(config) as node:
        assert node.record.name == "from-config"
        assert node.record.lanes == 3
        assert node.snapshot().mux is None
        assert node.address[0] == "127.0.0.1"


async def test_keywords_to_open_node_replace_the_configs_values(
    tmp_path: Path,
    make_credentials: Callable[..., NodeCredentials],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = make_credentials("configured").save(tmp_path / "creds")
    config = NodeConfig(credentials=str(directory), name="from-config")
    monkeypatch.setenv("VELOMUX_NODE_NAME", "from-environment")  # read by load(), not here
    async with open_node(config, name="from-keyword", mux=MuxConfig(enabled=False)) as node:
        assert node.record.name == "from-keyword"
        assert node.snapshot().mux is None
    with pytest.raises(ConfigurationError, match="port must be 0 to 65535"):
        async with open_node(config, port=70000):
            pass


async def test_the_rollback_variables_turn_off_the_mux_of_any_node(
    tmp_path: Path,
    make_credentials: Callable[..., NodeCredentials],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = make_credentials("rolled-back").save(tmp_path / "creds")
    monkeypatch.setenv("VELO_MESSENGER_MUX_DISABLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with open_node(directory) as node:
            assert node.snapshot().mux is None
    monkeypatch.delenv("VELO_MESSENGER_MUX_DISABLE")
    monkeypatch.setenv("VELOMUX_MUX_DISABLE", "1")
    with pytest.warns(DeprecationWarning, match="VELOMUX_MUX_DISABLE is deprecated") as seen:
        async with open_node(directory) as node:
            assert node.snapshot().mux is None
    assert [warning.filename for warning in seen] == [__file__]


async def test_configured_peers_and_peer_directory_are_used(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    directory = make_credentials("with-peers").save(tmp_path / "creds")
    peer = new_instance_id()
    config = NodeConfig(
        credentials=str(directory),
        peers=(PeerEntry(str(peer), "127.0.0.1:7999", "elsewhere"),),
        peer_directory=str(tmp_path / "peers"),
    )
    async with open_node(config) as node:
        known = {record.instance_id: record for record in node.snapshot().peers}
        assert known[peer].address == ("127.0.0.1", 7999) and known[peer].name == "elsewhere"
        assert (tmp_path / "peers" / f"{node.instance_id}.json").is_file()
    assert not (tmp_path / "peers" / f"{node.instance_id}.json").exists()  # withdrawn on close
