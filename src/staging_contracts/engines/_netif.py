"""Where an engine listens: this host's interfaces and a process's listening TCP sockets.

The engines check at start-up which TCP listeners their native library opened, and warn
when one listens beyond the address they were given (a wildcard, or another interface). Both
halves are Linux-only, as the engines are: interface addresses come from ``getifaddrs(3)``
(the call UCX itself uses to pick the address it listens on), listening sockets from
``/proc/<pid>/net/tcp{,6}`` matched against the socket inodes of ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Final, NamedTuple

__all__ = [
    "ListeningSocket",
    "interface_addresses",
    "interface_of",
    "is_wildcard",
    "listening_sockets",
    "resolve_host",
    "unconfined",
    "watch_listeners",
]

logger = logging.getLogger(__name__)

_LISTEN: Final = "0A"
"""``st`` of a listening socket in ``/proc/net/tcp``."""
WILDCARDS: Final = frozenset({"0.0.0.0", "::"})


class ListeningSocket(NamedTuple):
    """One listening TCP socket: its local address (no brackets) and port."""

    address: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def is_wildcard(address: str) -> bool:
    """Whether ``address`` means every interface (``0.0.0.0``, ``::`` or empty)."""
    return address.strip("[]") in WILDCARDS or not address


def resolve_host(host: str) -> str:
    """``host`` as a numeric address (a name is resolved; brackets are dropped).

    Raises:
        OSError: the name does not resolve.
    """
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_ushort),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_ubyte * 4),
    ]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [
        ("sin6_family", ctypes.c_ushort),
        ("sin6_port", ctypes.c_uint16),
        ("sin6_flowinfo", ctypes.c_uint32),
        ("sin6_addr", ctypes.c_ubyte * 16),
        ("sin6_scope_id", ctypes.c_uint32),
    ]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
    ("ifa_data", ctypes.c_void_p),
]


def _sockaddr_text(pointer: ctypes._Pointer[_Sockaddr]) -> str | None:
    if not pointer:
        return None
    family = int(pointer.contents.sa_family)
    if family == socket.AF_INET:
        v4 = ctypes.cast(pointer, ctypes.POINTER(_SockaddrIn)).contents
        return str(ipaddress.IPv4Address(bytes(v4.sin_addr)))
    if family == socket.AF_INET6:
        v6 = ctypes.cast(pointer, ctypes.POINTER(_SockaddrIn6)).contents
        return str(ipaddress.IPv6Address(bytes(v6.sin6_addr)))
    return None


def interface_addresses() -> dict[str, list[str]]:
    """Every network interface with its IPv4 and IPv6 addresses, in ``getifaddrs`` order.

    Raises:
        OSError: ``getifaddrs`` failed or libc has no such call.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    getifaddrs: Callable[[ctypes._Pointer[ctypes._Pointer[_Ifaddrs]]], int] = libc.getifaddrs
    freeifaddrs: Callable[[ctypes._Pointer[_Ifaddrs]], None] = libc.freeifaddrs
    head = ctypes.POINTER(_Ifaddrs)()
    if getifaddrs(ctypes.pointer(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs failed: {os.strerror(errno)}")
    found: dict[str, list[str]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = (entry.ifa_name or b"").decode(errors="replace")
            address = _sockaddr_text(entry.ifa_addr)
            if address is not None:
                found.setdefault(name, []).append(address)
            node = entry.ifa_next
    finally:
        freeifaddrs(head)
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` (``None``: none does).

    Raises:
        OSError: the interfaces cannot be listed.
    """
    wanted = ipaddress.ip_address(address.strip("[]"))
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def _hex_address(text: str) -> str:
    """An address of ``/proc/net/tcp{,6}``: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_sockets(pid: int | None = None) -> frozenset[ListeningSocket]:
    """The TCP sockets process ``pid`` (default: this one) listens on.

    Raises:
        OSError: ``/proc`` of that process cannot be read (not Linux, or no permission).
    """
    proc = f"/proc/{'self' if pid is None else pid}"
    inodes: set[str] = set()
    for fd in os.listdir(f"{proc}/fd"):
        try:
            target = os.readlink(f"{proc}/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: set[ListeningSocket] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}", encoding="ascii") as handle:
                lines = handle.readlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN or fields[9] not in inodes:
                continue
            address, _, port = fields[1].partition(":")
            found.add(ListeningSocket(_hex_address(address), int(port, 16)))
    return frozenset(found)


def unconfined(
    listeners: Collection[ListeningSocket], allowed: Collection[str]
) -> list[ListeningSocket]:
    """The listeners whose address is not one of ``allowed``, sorted."""
    permitted = {str(ipaddress.ip_address(a.strip("[]"))) for a in allowed}
    return sorted(item for item in listeners if item.address not in permitted)


@contextmanager
def watch_listeners() -> Iterator[set[ListeningSocket]]:
    """Collect the TCP listeners this process opens inside the ``with`` block.

    The yielded set is filled when the block ends; it stays empty where ``/proc`` cannot be
    read (logged). Listeners opened meanwhile by other threads count too.
    """
    opened: set[ListeningSocket] = set()
    try:
        before: frozenset[ListeningSocket] | None = listening_sockets()
    except OSError as exc:
        logger.info("cannot list this process's listening sockets: %s", exc)
        before = None
    yield opened
    if before is None:
        return
    try:
        opened.update(listening_sockets() - before)
    except OSError as exc:
        logger.info("cannot list this process's listening sockets: %s", exc)
