"""The network interface a rank of a multi-host run uses toward the other hosts.

Each collective library picks the address it advertises to its peers on its own, and none picks by where
the peers are: gloo takes the address the host name resolves to (127.0.0.1, or 127.0.1.1 on many Debian
hosts: a rank on another host is then refused in connectFullMesh), HCCL the first interface by name
(not docker, not lo), NCCL its own order. The right one is the interface that owns this host's address
on the route to MASTER_ADDR (node 0). `toward(MASTER_ADDR)` finds it; `settings(...)` names it in each
library's variable, leaving the ones the user set:

- GLOO_SOCKET_IFNAME=IFACE (gloo: the CPU backend, and the NPU stand-in's HCCL);
- NCCL_SOCKET_IFNAME==IFACE (NCCL: "=" asks for that exact name, not a prefix);
- HCCL_IF_IP=ADDRESS where neither HCCL_IF_IP nor HCCL_SOCKET_IFNAME is set (HCCL: the host address
  for the root negotiation; HCCL_IF_IP is read before HCCL_SOCKET_IFNAME, so a user's interface name is
  not overridden).

Standard library only: the stand-in loads this file in processes without infer-migrator installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from dataclasses import dataclass

GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"
HCCL_IP = "HCCL_IF_IP"
HCCL_IFNAME = "HCCL_SOCKET_IFNAME"
VARIABLES = (GLOO, NCCL, HCCL_IP)


class NoRoute(ValueError):
    """MASTER_ADDR cannot be resolved or reached from this host."""


@dataclass(frozen=True)
class Route:
    master: str          # MASTER_ADDR as given
    address: str         # this host's address on the route to it
    interface: str | None  # the interface that owns `address` (None: not found)


def local_address(master: str, port: int = 9) -> str:
    """This host's source address for packets to `master` (a UDP connect sends nothing; the kernel picks the
    route). Toward one of this host's own addresses it is that address (the route goes through lo, but
    the address belongs to its interface)."""
    try:
        infos = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NoRoute(f"MASTER_ADDR={master!r} does not resolve here ({exc})") from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return sock.getsockname()[0].split("%", 1)[0]
        except OSError as exc:
            errors.append(str(exc.strerror or exc))
    raise NoRoute(f"MASTER_ADDR={master!r}: no route from this host ({'; '.join(errors) or 'no address'})")


def interfaces() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4/IPv6 address of this host, secondary addresses included
    (getifaddrs); [] where libc has no getifaddrs."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError, TypeError):
        return []

    class SockAddr(ctypes.Structure):
        _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]

    class IfAddrs(ctypes.Structure):
        pass

    IfAddrs._fields_ = [("next", ctypes.POINTER(IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                        ("addr", ctypes.POINTER(SockAddr)), ("netmask", ctypes.POINTER(SockAddr)),
                        ("ifu", ctypes.POINTER(SockAddr)), ("data", ctypes.c_void_p)]
    head = ctypes.POINTER(IfAddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr:
                family, data = item.addr.contents.family, bytes(item.addr.contents.data)
                # Linux layouts: sockaddr_in (port, 4 address bytes), sockaddr_in6 (port, flowinfo, 16 bytes)
                if family == socket.AF_INET:
                    found.append((item.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET, data[2:6])))
                elif family == socket.AF_INET6:
                    found.append((item.name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET6, data[6:22])))
            entry = item.next
    finally:
        freeifaddrs(head)
    return found


def interface_of(address: str, table: list[tuple[str, str]] | None = None) -> str | None:
    """The interface that owns `address` (a loopback address: the loopback interface)."""
    table = interfaces() if table is None else table
    want = ipaddress.ip_address(address)
    for name, owned in table:
        if ipaddress.ip_address(owned) == want:
            return name
    if want.is_loopback:
        return next((name for name, owned in table if ipaddress.ip_address(owned).is_loopback), None)
    return None


def toward(master: str, port: int = 9) -> Route:
    address = local_address(master, port)
    return Route(master, address, interface_of(address))


def settings(route: Route, environ) -> dict[str, str]:
    """The variables to export so that gloo, NCCL and HCCL use `route`'s interface; a variable the
    user set (HCCL: either of its two) is left as it is."""
    wanted = {}
    if route.interface:
        wanted[GLOO] = route.interface
        wanted[NCCL] = f"={route.interface}"
    if not (environ.get(HCCL_IP) or environ.get(HCCL_IFNAME)):
        wanted[HCCL_IP] = route.address
    return {key: value for key, value in wanted.items() if not environ.get(key)}


def describe(route: Route, chosen: dict[str, str], environ, keys=(*VARIABLES, HCCL_IFNAME)) -> str:
    """One line: the interface toward MASTER_ADDR, what `chosen` sets and which of `keys` the user's
    environment (before `chosen`) already set."""
    where = f"interface {route.interface} ({route.address})" if route.interface else \
        f"address {route.address} (no interface owns it here)"
    told = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "nothing"
    kept = [f"{k}={environ[k]}" for k in keys if environ.get(k) and k not in chosen]
    return f"toward MASTER_ADDR={route.master}: {where}; set {told}" + (f"; kept {', '.join(kept)}" if kept else "")
