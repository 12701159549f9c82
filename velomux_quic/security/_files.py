"""Reading and writing credential files; a private key is never readable by others, even briefly.

Every file is written to a fresh temporary name in the same directory and renamed over
the target, so a reader (a node starting up, a second ``certs dev`` run) sees either the
old file or the new one, never half of one. Private keys are created with mode 0600 by
``os.open`` itself: writing first and ``chmod``-ing afterwards would leave a window in
which the key sits on disk with the umask's permissions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import CredentialsError

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "PUBLIC_FILE_MODE",
    "CredentialsError",
    "certificates_pem",
    "directory_lock",
    "make_private_dir",
    "private_key_pem",
    "read_bytes",
    "read_certificates",
    "read_ec_private_key",
    "refuse_overwrite",
    "warn_if_exposed",
    "write_private",
    "write_public",
]

_log = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise CredentialsError(
            f"{path} is missing: create it with 'velomux certs issue' (or 'velomux certs "
            "dev' for a local dev cluster, in certs/dev), or point the node at the directory "
            "that holds it"
        ) from exc
    except NotADirectoryError as exc:
        raise CredentialsError(
            f"{path.parent} is a file, not a credentials directory: give the directory that "
            "holds node.pem, node.key, ca.pem and node.json (what 'velomux certs issue' or "
            "'velomux certs dev' writes)"
        ) from exc
    except IsADirectoryError as exc:
        raise CredentialsError(
            f"{path} could not be read: it is a directory, not a file: recreate the "
            "credentials with 'velomux certs issue'"
        ) from exc
    except PermissionError as exc:
        raise CredentialsError(
            f"{path} could not be read by this user: fix its owner or mode (keys are 0600)"
        ) from exc


def read_certificates(path: Path) -> list[x509.Certificate]:
    """Every certificate in a PEM file, in file order (leaf first, for a chain file)."""
    data = read_bytes(path)  # a missing file says so, not "unreadable"
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise CredentialsError(f"{path}: no readable PEM certificate ({exc})") from exc


def read_ec_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """An unencrypted PEM ECDSA key; a node must start unattended, so no passphrase."""
    data = read_bytes(path)  # a missing file says so, not "not a PEM key"
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CredentialsError(f"{path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError(f"{path}: expected an ECDSA key, found {type(key).__name__}")
    warn_if_exposed(path)
    return key


def certificates_pem(certs: Iterable[x509.Certificate]) -> bytes:
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def refuse_overwrite(path: Path, overwrite: bool) -> None:
    """Raise ``FileExistsError`` if ``path`` exists and replacing it was not asked for."""
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists; refusing to replace a private key")


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with the last component mode 0700.

    An existing directory is left as it is: it belongs to the operator, who may have
    chosen its permissions for a reason (a group-readable ``certs/`` for a service user).
    """
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        if hasattr(os, "fchmod"):
            # The umask can only remove bits; set the exact mode so a key is 0600
            # whatever the umask, and a certificate readable by the node's peers' tools.
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_private(path: Path, data: bytes) -> None:
    """Atomically write a private key, mode 0600 from the moment the file exists."""
    _write_atomic(path, data, PRIVATE_FILE_MODE)


def write_public(path: Path, data: bytes) -> None:
    """Atomically write a certificate or metadata file, mode 0644."""
    _write_atomic(path, data, PUBLIC_FILE_MODE)


def warn_if_exposed(path: Path) -> None:
    """Log a warning when a key file is readable by group or others.

    A warning rather than a refusal: keys copied by configuration management sometimes
    arrive 0640 for a service group, and refusing to start would turn a hygiene issue
    into an outage.
    """
    if os.name != "posix":
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        _log.warning(
            "private key %s has mode %o; it should be readable by its owner only (chmod 600)",
            path,
            mode,
        )


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``directory`` (no-op where fcntl is missing).

    Two processes creating the same dev cluster at once (parallel test runs, ``make demo``
    started twice) would otherwise each make a CA and sign nodes with different ones.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
