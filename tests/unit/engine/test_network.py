"""The interface a multi-host run's ranks use toward MASTER_ADDR (engine/network.py), and the variables
engine.launch exports for it. The run across two hosts: tests/e2e/test_two_hosts.py."""

from __future__ import annotations

import ipaddress

import pytest

from engine import network
from engine.config import ConfigError
from engine.launch import network_environment


def _own_address() -> tuple[str, str]:
    """(interface, address) of one of this host's non-loopback IPv4 addresses."""
    for name, address in network.interfaces():
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and not ip.is_loopback:
            return name, address
    pytest.skip("this host has no non-loopback IPv4 address")


def test_interfaces_lists_the_loopback_address():
    assert ("lo", "127.0.0.1") in network.interfaces() or \
        any(ipaddress.ip_address(a).is_loopback for _, a in network.interfaces())


@pytest.mark.parametrize("master", ["127.0.0.1", "localhost", "127.0.1.1"])
def test_toward_a_loopback_master_is_the_loopback_interface(master):
    route = network.toward(master)
    assert ipaddress.ip_address(route.address).is_loopback
    assert route.interface == network.interface_of("127.0.0.1")


def test_toward_this_hosts_own_address_is_the_interface_that_owns_it_not_loopback():
    """Node 0 itself: the kernel's route to its own address goes through lo, but its peers reach it on the
    interface that owns MASTER_ADDR, and that is the one gloo must bind and advertise."""
    name, address = _own_address()
    route = network.toward(address)
    assert (route.address, route.interface) == (address, name)
    assert route.interface != network.interface_of("127.0.0.1")


def test_toward_another_host_is_the_interface_of_this_hosts_source_address():
    try:
        route = network.toward("203.0.113.7")            # TEST-NET-3: off this host, routed by the default route
    except network.NoRoute as exc:
        pytest.skip(f"no default route here: {exc}")
    assert route.interface is not None
    assert (route.interface, route.address) in network.interfaces()
    assert not ipaddress.ip_address(route.address).is_loopback


@pytest.mark.parametrize("master, says", [
    ("no-such-host.invalid", "does not resolve here"),
    ("10.231.44.1 ; rm -rf /", "does not resolve here"),
    ("", "does not resolve here"),                        # engine.launch reads an empty one as 127.0.0.1
    ("fe80::1", "no route from this host"),               # link-local without a scope: no interface to send on
])
def test_a_master_that_does_not_resolve_is_no_route_in_one_line(master, says):
    with pytest.raises(network.NoRoute) as err:
        network.toward(master)
    assert says in str(err.value) and "\n" not in str(err.value) and repr(master) in str(err.value)


TABLE = [("lo", "127.0.0.1"), ("eth0", "192.0.2.2"), ("eth0", "192.0.2.50"), ("bond1", "10.1.2.3"),
         ("lo", "::1"), ("eth0", "fd00::2")]


@pytest.mark.parametrize("address, interface", [
    ("192.0.2.2", "eth0"), ("192.0.2.50", "eth0"),         # a secondary address of the same interface
    ("10.1.2.3", "bond1"), ("fd00::2", "eth0"), ("::1", "lo"),
    ("127.0.1.1", "lo"),                                    # Debian's host-name address: on lo's 127/8
    ("198.51.100.1", None),                                 # owned by no interface here
])
def test_interface_of_an_address(address, interface):
    assert network.interface_of(address, TABLE) == interface


ROUTE = network.Route("10.1.2.1", "10.1.2.3", "bond1")


@pytest.mark.parametrize("environ, expected", [
    ({}, {"GLOO_SOCKET_IFNAME": "bond1", "NCCL_SOCKET_IFNAME": "=bond1", "HCCL_IF_IP": "10.1.2.3"}),
    ({"GLOO_SOCKET_IFNAME": "eth0"}, {"NCCL_SOCKET_IFNAME": "=bond1", "HCCL_IF_IP": "10.1.2.3"}),
    ({"NCCL_SOCKET_IFNAME": "ib"}, {"GLOO_SOCKET_IFNAME": "bond1", "HCCL_IF_IP": "10.1.2.3"}),
    # HCCL_IF_IP is read before HCCL_SOCKET_IFNAME: setting it would override the user's interface name
    ({"HCCL_SOCKET_IFNAME": "enp"}, {"GLOO_SOCKET_IFNAME": "bond1", "NCCL_SOCKET_IFNAME": "=bond1"}),
    ({"HCCL_IF_IP": "10.9.9.9"}, {"GLOO_SOCKET_IFNAME": "bond1", "NCCL_SOCKET_IFNAME": "=bond1"}),
    ({"GLOO_SOCKET_IFNAME": ""}, {"GLOO_SOCKET_IFNAME": "bond1", "NCCL_SOCKET_IFNAME": "=bond1",
                                  "HCCL_IF_IP": "10.1.2.3"}),       # set but empty: not a choice
])
def test_settings_name_the_interface_and_keep_what_the_user_set(environ, expected):
    assert network.settings(ROUTE, environ) == expected


def test_settings_without_an_interface_name_only_the_address():
    assert network.settings(network.Route("x", "10.1.2.3", None), {}) == {"HCCL_IF_IP": "10.1.2.3"}


def test_describe_says_what_was_set_and_what_was_kept():
    environ = {"GLOO_SOCKET_IFNAME": "eth0", "HCCL_SOCKET_IFNAME": "enp"}
    line = network.describe(ROUTE, network.settings(ROUTE, environ), environ)
    assert line == ("toward MASTER_ADDR=10.1.2.1: interface bond1 (10.1.2.3); set NCCL_SOCKET_IFNAME==bond1; "
                    "kept GLOO_SOCKET_IFNAME=eth0, HCCL_SOCKET_IFNAME=enp")


# ---- engine.launch: what a recipe's infer.sh runs -------------------------------------------------
@pytest.mark.parametrize("world_size, environ", [(1, {"NNODES": "2"}), (4, {}), (4, {"NNODES": "1"})])
def test_one_machine_sets_nothing(world_size, environ):
    assert network_environment(world_size, {**environ, "MASTER_ADDR": "no-such-host.invalid"}) == ({}, None)


def test_several_machines_set_the_interface_toward_master_addr():
    name, address = _own_address()
    chosen, line = network_environment(2, {"NNODES": "2", "MASTER_ADDR": address})
    assert chosen == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}", "HCCL_IF_IP": address}
    assert line.startswith(f"toward MASTER_ADDR={address}: interface {name} ({address})")


def test_several_machines_keep_the_users_interface():
    chosen, line = network_environment(2, {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9",
                                           "HCCL_SOCKET_IFNAME": "=eth9"})
    assert "GLOO_SOCKET_IFNAME" not in chosen and "HCCL_IF_IP" not in chosen
    assert "kept GLOO_SOCKET_IFNAME=eth9, HCCL_SOCKET_IFNAME==eth9" in line


def test_several_machines_without_a_master_addr_meet_on_loopback():
    chosen, _ = network_environment(2, {"NNODES": "2"})
    assert chosen["GLOO_SOCKET_IFNAME"] == network.interface_of("127.0.0.1")


def test_several_machines_with_an_unresolvable_master_addr_is_a_config_error():
    with pytest.raises(ConfigError, match=r"MASTER_ADDR='node-zero\.invalid' does not resolve here .*: set "
                                          r"MASTER_ADDR to node 0's address, reachable from every machine"):
        network_environment(2, {"NNODES": "2", "MASTER_ADDR": "node-zero.invalid"})
