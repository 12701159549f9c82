"""The node's one UDP socket, with buffers large enough for QUIC at speed."""

from __future__ import annotations

import logging
import socket
import sys

__all__ = ["BufferSizes", "forbid_fragmentation", "open_udp_socket"]

logger = logging.getLogger(__name__)

# Linux-only "force" variants bypass rmem_max/wmem_max when the process has CAP_NET_ADMIN.
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)

# Linux's <linux/in.h> and <linux/in6.h>; Python's socket module names none of them.
_IP_MTU_DISCOVER = 10
_IPV6_MTU_DISCOVER = 23
_PMTUDISC_PROBE = 3
"""Set DF on every datagram, and ignore the path MTU the kernel learned from ICMP: a
datagram larger than the device's MTU fails with EMSGSIZE, one larger than the path's
is dropped on the way. QUIC's own probing (DPLPMTUD) finds the size, not ICMP."""


class BufferSizes(tuple[int, int]):
    """(receive, send) socket buffer sizes as the kernel reports them."""

    @property
    def receive(self) -> int:
        return self[0]

    @property
    def send(self) -> int:
        return self[1]


def _request_buffer(sock: socket.socket, option: int, force_option: int, size: int) -> int:
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_option, size)
    except OSError:
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
        except OSError as exc:
            logger.warning("could not set UDP socket buffer option %d to %d: %s", option, size, exc)
    return int(sock.getsockopt(socket.SOL_SOCKET, option))


def forbid_fragmentation(sock: socket.socket) -> bool:
    """Set DF on the socket's datagrams (Linux ``IP_PMTUDISC_PROBE``); whether it could.

    Without it the kernel fragments a datagram too large for the path, and a probe for a
    larger size would pass as fragments: the search would raise the size past the path
    and every lost fragment would lose a whole packet.
    """
    if not sys.platform.startswith("linux"):
        return False
    done = False
    options = [(socket.IPPROTO_IP, _IP_MTU_DISCOVER)]
    if sock.family == socket.AF_INET6:
        options.append((socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER))
    for level, option in options:
        try:
            sock.setsockopt(level, option, _PMTUDISC_PROBE)
            done = True
        except OSError as exc:
            logger.debug("could not set DF (level %d option %d): %s", level, option, exc)
    return done


def open_udp_socket(
    host: str, port: int, *, receive_buffer: int, send_buffer: int
) -> tuple[socket.socket, BufferSizes]:
    """Bind a non-blocking UDP socket and ask for large buffers.

    The kernel default (~208 KiB) drops datagrams in any fast run, and a drop is silent:
    QUIC sees loss and slows down. When the kernel clamps the request (``rmem_max`` /
    ``wmem_max``), we log a warning naming the sysctl, because nothing else would show it.
    Linux reports twice the requested size (it counts its bookkeeping), so "clamped" means
    the reported size is below the request.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        receive = _request_buffer(sock, socket.SO_RCVBUF, _SO_RCVBUFFORCE, receive_buffer)
        send = _request_buffer(sock, socket.SO_SNDBUF, _SO_SNDBUFFORCE, send_buffer)
        if receive < receive_buffer:
            logger.warning(
                "UDP receive buffer clamped to %d bytes (asked %d); raise net.core.rmem_max",
                receive,
                receive_buffer,
            )
        if send < send_buffer:
            logger.warning(
                "UDP send buffer clamped to %d bytes (asked %d); raise net.core.wmem_max",
                send,
                send_buffer,
            )
        if not forbid_fragmentation(sock):
            logger.info("datagrams may be fragmented here: no path MTU probing guard (DF)")
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, BufferSizes((receive, send))
