"""NodeConfig: every setting of a node, declared once, from code, a TOML file or the environment.

It is the one front door to a node's settings: :func:`~velomux_quic.open_node` and
:meth:`~velomux_quic.Node.start` take a NodeConfig, and their setting keywords (``port=``,
``mux=``...) are its fields by the same names. Where a setting comes from follows one rule,
the first that sets it wins::

    keywords  >  environment  >  file  >  defaults

    config = NodeConfig.load("node.toml", port=7000)  # VELOMUX_TRANSPORT_LANES=4 sets lanes
    async with open_node(config) as node:
        ...

:meth:`NodeConfig.load` applies the whole rule (the file is optional; the environment is
``os.environ`` unless given); :meth:`from_toml` is ``load`` without keywords;
``open_node(config, port=7000)`` applies its keywords over the config it is given, the
same way. A NodeConfig built in code is read as given: the environment reaches a node
through ``load``, except the design chapter's rollback variable, which every node reads
when it is built (see :mod:`velomux_quic.mux.config`).

The file has a ``[node]`` section for the node's own keys, one ``[[peers]]`` table per
statically known peer, and one section per layer (``[transport]``, ``[messenger]``,
``[streaming]``, ``[mux]``, with ``[mux.flush_policy]``) whose keys are the fields of
that layer's config class, and a ``[discovery]`` section (:class:`DiscoveryConfig`: how
the node finds the others: none, a shared directory, or etcd). The environment sets one
key as ``VELOMUX_<SECTION>_<KEY>`` (``VELOMUX_NODE_PORT=7000``, ``VELOMUX_MUX_ENABLED=false``).
Every key is optional; an absent key takes the class's default. A keyword sets the whole
value it names (``transport=TransportConfig(...)`` replaces the file's and the
environment's ``[transport]``). A bad value (unknown key, wrong type, out of range) raises
:class:`~velomux_quic.errors.ConfigurationError` naming the file or environment
variable, the key and the reason: the layers' own validation decides what is in range,
so a rule is written once.

A new section is one entry in ``_SECTIONS`` (its name, the NodeConfig field and the
config class), so a later layer adds its keys without touching the loader.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tomllib
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .discovery import DiscoveryConfig, PeerEntry, PeerRecord
from .errors import ConfigurationError
from .messenger import MessengerConfig
from .mux.config import (
    CHAPTER_DISABLE_ENV,
    DISABLE_ENV,
    AutoFlush,
    FlushPolicy,
    Manual,
    MuxConfig,
    switch_is_on,
)
from .streaming.config import StreamingConfig
from .transport.config import TransportConfig

__all__ = ["DEPRECATED_VARIABLES", "ENV_PREFIX", "NodeConfig"]

ENV_PREFIX = "VELOMUX_"
"""Environment overrides are ``VELOMUX_<SECTION>_<KEY>`` (``VELOMUX_NODE_PORT=7000``); every
variable the project reads starts with it (the design chapter's
``VELO_MESSENGER_MUX_DISABLE`` aside, read under the chapter's name on purpose)."""

DEPRECATED_VARIABLES: Mapping[str, str] = {
    DISABLE_ENV: (
        "set VELOMUX_MUX_ENABLED=false (enabled = false under [mux] in the file), or the design "
        f"chapter's {CHAPTER_DISABLE_ENV}=1, which every node reads"
    ),
}
"""Variables still read, with a DeprecationWarning, for one release, and what to set instead."""

_SWITCHES = frozenset(DEPRECATED_VARIABLES)
"""Variables under a section's prefix that are no key of it: the mux's old switch, which
sets ``[mux] enabled`` here and is read again where a node is built from a config made
in code."""

_NO_VALUE = frozenset({"none", "null", ""})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How to start one node: its credentials, address, peers and every layer's config.

    The one declaration of a node's settings: the setting keywords of
    :func:`~velomux_quic.open_node` and :meth:`~velomux_quic.Node.start` are these
    fields. Frozen and validated on construction: a NodeConfig in hand starts a node (if
    its credentials exist). Build one in code, or with :meth:`load` from a file, the
    environment and keywords (keywords > environment > file > defaults); pass it to
    :func:`~velomux_quic.open_node` or :meth:`~velomux_quic.Node.start`.
    """

    credentials: str = "certs/dev/node-a"
    """Directory with ``node.pem``, ``node.key``, ``ca.pem`` and ``node.json``."""
    host: str = "127.0.0.1"
    """Address the node's UDP endpoint binds."""
    port: int = 0
    """UDP port (0: any free port)."""
    name: str = ""
    """Label in records and logs ("" : the credentials' name)."""
    peer_directory: str | None = None
    """A directory shared by the nodes of one host (DirectoryPeers); None: no discovery."""
    peers: tuple[PeerEntry, ...] = ()
    """Peers known from the start."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    messenger: MessengerConfig = field(default_factory=MessengerConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    mux: MuxConfig = field(default_factory=MuxConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.credentials, str) or not self.credentials:
            raise ConfigurationError("credentials must be a directory path")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigurationError("host must be a non-empty string")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ConfigurationError(f"port must be an integer, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"port must be 0 to 65535, got {self.port}")
        if self.peer_directory is not None and self.discovery.backend != "none":
            raise ConfigurationError(
                f"peer_directory and discovery.backend = {self.discovery.backend!r} both choose "
                "the discovery: keep one"
            )
        for index, peer in enumerate(self.peers):
            try:
                peer.record()
            except ConfigurationError as error:
                raise ConfigurationError(f"peers[{index}]: {error}") from None

    def peer_records(self) -> list[PeerRecord]:
        """The configured peers as PeerRecords."""
        return [peer.record() for peer in self.peers]

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        **keywords: Any,
    ) -> NodeConfig:
        """The settings by the one rule: ``keywords`` > environment > file > defaults.

        ``path`` is a TOML file (None: no file); ``environ`` holds the
        ``VELOMUX_<SECTION>_<KEY>`` overrides (``os.environ`` when None; ``{}`` reads
        none); ``keywords`` are NodeConfig fields by name, each replacing what the file and
        the environment said of it (a layer's config as a whole). Relative paths
        (``credentials``, ``peer_directory``) are relative to the working directory, as
        they are in code. Raises ConfigurationError naming the file (or the variable, or
        the keyword), the key and the reason.
        """
        document: Mapping[str, Any] = {}
        source = "<defaults>"
        if path is not None:
            source = str(path)
            document = _read(Path(path))
        env = os.environ if environ is None else environ
        return _Loader(source).load(document, env).override(**keywords)

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> NodeConfig:
        """Load a TOML file, then apply ``VELOMUX_<SECTION>_<KEY>`` overrides: :meth:`load`
        with a file and no keywords."""
        return cls.load(path, environ=environ)

    def override(self, **keywords: Any) -> NodeConfig:
        """This config with ``keywords`` (fields by name) replacing its values: the
        keywords' place at the top of the rule, as ``open_node(config, port=...)`` applies
        them. A name that is no field raises ConfigurationError listing the fields."""
        fields = [f.name for f in dataclasses.fields(self)]
        if unknown := sorted(set(keywords) - set(fields)):
            raise ConfigurationError(
                f"{', '.join(map(repr, unknown))}: no such setting; the settings of a node "
                f"are {', '.join(fields)} (NodeConfig)"
            )
        return dataclasses.replace(self, **keywords) if keywords else self

    @classmethod
    def from_mapping(
        cls,
        document: Mapping[str, Any],
        *,
        source: str = "<config>",
        environ: Mapping[str, str] | None = None,
    ) -> NodeConfig:
        """Build from a parsed document (the shape of the TOML file); see :meth:`from_toml`.

        ``source`` names the document in errors; ``environ`` holds the
        ``VELOMUX_<SECTION>_<KEY>`` overrides to apply (none by default, not
        ``os.environ``: a program that builds the mapping decides).
        """
        return _Loader(source).load(document, environ or {})


# -- the loader -----------------------------------------------------------------------


def _read(source: Path) -> dict[str, Any]:
    try:
        with source.open("rb") as stream:
            return tomllib.load(stream)
    except FileNotFoundError:
        raise ConfigurationError(f"{source}: no such configuration file") from None
    except OSError as error:
        raise ConfigurationError(f"{source}: cannot read it: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"{source}: not valid TOML: {error}") from None


_SECTIONS: dict[str, type[Any]] = {
    "transport": TransportConfig,
    "messenger": MessengerConfig,
    "streaming": StreamingConfig,
    "mux": MuxConfig,
    "discovery": DiscoveryConfig,
}
"""Each layer's section: its name in the file (and the NodeConfig field) and its class."""

_NODE_KEYS = ("credentials", "host", "port", "name", "peer_directory")
_FLUSH_KINDS: dict[str, type[Any]] = {"auto": AutoFlush, "manual": Manual}


class _Loader:
    """Turns one document (plus the environment) into a NodeConfig, remembering where
    each value came from so that an error names it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, reason: str) -> ConfigurationError:
        return ConfigurationError(f"{where}: {reason}")

    def load(self, document: Mapping[str, Any], environ: Mapping[str, str]) -> NodeConfig:
        allowed = {"node", "peers", *_SECTIONS}
        for key in document:
            if key not in allowed:
                raise self.fail(
                    f"{self.source}: [{key}]",
                    f"unknown section; the sections are {', '.join(sorted(allowed))}",
                )
        node_table = self.table(document, "node")
        hints = typing.get_type_hints(NodeConfig)
        node_values: dict[str, Any] = {}
        for key, value in node_table.items():
            where = f"{self.source}: node.{key}"
            if key == "peers":
                raise self.fail(where, "peers are [[peers]] tables at the top level")
            if key not in _NODE_KEYS:
                raise self.fail(where, f"unknown key; the keys are {', '.join(_NODE_KEYS)}")
            node_values[key] = self.checked(where, value, hints[key])
        overrides = self.env_overrides(environ, "node", dict.fromkeys(_NODE_KEYS), hints)
        node_values.update(overrides)
        node_values["peers"] = self.peers(document.get("peers", []))
        for section, config_class in _SECTIONS.items():
            node_values[section] = self.layer(document, environ, section, config_class)
        try:
            return NodeConfig(**node_values)
        except ConfigurationError as error:
            raise self.fail(
                self.culprits("node", node_values, overrides, error), str(error)
            ) from None

    def culprits(
        self,
        section: str,
        values: Mapping[str, Any],
        overrides: Mapping[str, Any],
        error: Exception,
    ) -> str:
        """Where the keys a validation message names came from: the file or a variable."""
        named = [
            f"environment {ENV_PREFIX}{section.upper()}_{key.upper()}"
            if key in overrides
            else f"{self.source}: {section}.{key}"
            for key in values
            if key in str(error)
        ]
        return ", ".join(named) or f"{self.source}: [{section}]"

    def table(self, document: Mapping[str, Any], name: str) -> dict[str, Any]:
        value = document.get(name, {})
        if not isinstance(value, dict):
            raise self.fail(f"{self.source}: {name}", f"must be a [{name}] table")
        return value

    def peers(self, entries: Any) -> tuple[PeerEntry, ...]:
        if not isinstance(entries, list):
            raise self.fail(f"{self.source}: peers", "must be [[peers]] tables")
        result = []
        keys = [f.name for f in dataclasses.fields(PeerEntry)]
        for index, entry in enumerate(entries):
            where = f"{self.source}: peers[{index}]"
            if not isinstance(entry, dict):
                raise self.fail(where, "must be a table with instance_id, address, name")
            for key, value in entry.items():
                if key not in keys:
                    raise self.fail(
                        f"{where}.{key}", f"unknown key; the keys are {', '.join(keys)}"
                    )
                if not isinstance(value, str):
                    raise self.fail(f"{where}.{key}", f"must be a string, got {value!r}")
            for key in ("instance_id", "address"):
                if key not in entry:
                    raise self.fail(f"{where}.{key}", "missing")
            peer = PeerEntry(**entry)
            try:
                peer.record()
            except ConfigurationError as error:
                raise self.fail(where, str(error)) from None
            result.append(peer)
        return tuple(result)

    def layer(
        self,
        document: Mapping[str, Any],
        environ: Mapping[str, str],
        section: str,
        config_class: type[Any],
    ) -> Any:
        table = dict(self.table(document, section))
        hints = typing.get_type_hints(config_class)
        keys = {f.name: hints[f.name] for f in dataclasses.fields(config_class)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            where = f"{self.source}: {section}.{key}"
            if key not in keys:
                raise self.fail(where, f"unknown key; the keys are {', '.join(keys)}")
            if key == "flush_policy":
                values[key] = self.flush_policy(where, value)
            else:
                values[key] = self.checked(where, value, keys[key])
        scalar_keys = {k: v for k, v in keys.items() if k != "flush_policy"}
        overrides = self.env_overrides(environ, section, scalar_keys, hints)
        if section == "mux" and DISABLE_ENV in environ:
            # The switch's earlier name: it sets `enabled`, unless VELOMUX_MUX_ENABLED does.
            warn_deprecated_variable(DISABLE_ENV)
            if switch_is_on(DISABLE_ENV, environ):
                overrides.setdefault("enabled", False)
        values.update(overrides)
        try:
            return config_class(**values)
        except (ConfigurationError, ValueError, TypeError) as error:
            # The layer's message names its field; say where that field's value came from.
            raise self.fail(self.culprits(section, values, overrides, error), str(error)) from None

    def flush_policy(self, where: str, value: Any) -> FlushPolicy:
        if not isinstance(value, dict):
            raise self.fail(where, 'must be a table with kind = "auto" or "manual"')
        table = dict(value)
        kind = table.pop("kind", "auto")
        policy_class = _FLUSH_KINDS.get(kind) if isinstance(kind, str) else None
        if policy_class is None:
            raise self.fail(f"{where}.kind", f'must be "auto" or "manual", got {kind!r}')
        hints = typing.get_type_hints(policy_class)
        keys = {f.name: hints[f.name] for f in dataclasses.fields(policy_class)}
        values = {}
        for key, item in table.items():
            if key not in keys:
                raise self.fail(
                    f"{where}.{key}",
                    f"unknown key for kind {kind!r}; the keys are kind, {', '.join(keys)}",
                )
            values[key] = self.checked(f"{where}.{key}", item, keys[key])
        try:
            policy: FlushPolicy = policy_class(**values)
        except ConfigurationError as error:
            raise self.fail(where, str(error)) from None
        return policy

    def env_overrides(
        self,
        environ: Mapping[str, str],
        section: str,
        keys: Mapping[str, Any],
        hints: Mapping[str, Any],
    ) -> dict[str, Any]:
        values: dict[str, Any] = {}
        prefix = f"{ENV_PREFIX}{section.upper()}_"
        for key in keys:
            variable = prefix + key.upper()
            if variable in environ:
                if variable in DEPRECATED_VARIABLES:
                    warn_deprecated_variable(variable)
                values[key] = self.parsed(f"environment {variable}", environ[variable], hints[key])
        # A misspelt override would otherwise be ignored without a word.
        known = {prefix + key.upper() for key in keys} | _SWITCHES
        for variable in sorted(environ):
            if variable.startswith(prefix) and variable not in known:
                raise self.fail(
                    f"environment {variable}",
                    f"no such key in [{section}] (peers and the flush policy are set in the "
                    f"file only); the keys are {', '.join(keys)}",
                )
        return values

    def checked(self, where: str, value: Any, annotation: Any) -> Any:
        """A TOML value of the field's type (an int is a float too); else an error."""
        if typing.get_origin(annotation) is tuple:
            # A list of strings (etcd_endpoints): TOML's array, kept as a tuple.
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise self.fail(where, f"must be a list of strings, got {value!r}")
            return tuple(value)
        kinds = _kinds(annotation)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(where, f"must be {_describe(kinds)}, got a boolean")
        if not isinstance(value, tuple(kind for kind in kinds if kind is not type(None))):
            raise self.fail(where, f"must be {_describe(kinds)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(where, f"must be a finite number, got {value!r}")
        return value

    def parsed(self, where: str, text: str, annotation: Any) -> Any:
        """An environment variable's text, parsed by the field's type."""
        if typing.get_origin(annotation) is tuple:
            # A list is comma-separated: VELOMUX_DISCOVERY_ETCD_ENDPOINTS=10.0.0.1:2379,...
            return tuple(item.strip() for item in text.split(",") if item.strip())
        kinds = _kinds(annotation)
        stripped = text.strip()
        if type(None) in kinds and stripped.lower() in _NO_VALUE:
            return None
        if bool in kinds:
            if stripped.lower() in _TRUE:
                return True
            if stripped.lower() in _FALSE:
                return False
        if int in kinds:
            try:
                return int(stripped)
            except ValueError:
                pass
        if float in kinds:
            try:
                number = float(stripped)
            except ValueError:
                pass
            else:
                return self.checked(where, number, annotation)
        if str in kinds:
            return text
        raise self.fail(where, f"must be {_describe(kinds)}, got {text!r}")


def warn_deprecated_variable(variable: str) -> None:
    """A DeprecationWarning naming the variable and its replacement, attributed to the first
    caller outside this package (the line that loaded the configuration)."""
    level = 2  # this function's caller
    frame: types.FrameType | None = sys._getframe(1)
    package = os.path.dirname(__file__) + os.sep
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"environment variable {variable} is deprecated and read for one more release only: "
        f"{DEPRECATED_VARIABLES[variable]}",
        DeprecationWarning,
        stacklevel=level,
    )


def _kinds(annotation: Any) -> tuple[type[Any], ...]:
    """The types a field's value may have; a ``Literal``'s values count as their type (the
    dataclass itself refuses a value outside them, naming the ones it takes)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = typing.get_args(annotation)
    else:
        members = (annotation,)
    kinds: list[type[Any]] = []
    for member in members:
        if typing.get_origin(member) is typing.Literal:
            kinds.extend(type(value) for value in typing.get_args(member))
        else:
            kinds.append(member)
    return tuple(dict.fromkeys(kinds))


def _describe(kinds: tuple[type[Any], ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    words = [names.get(kind, kind.__name__) for kind in kinds if kind is not type(None)]
    text = " or ".join(words)
    return f"{text} (or absent)" if type(None) in kinds else text
