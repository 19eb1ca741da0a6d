"""Where a stand-in run's ranks meet (npu_standin/dist.py), as upstream's function.sh and torchrun launch them:
on one host on loopback at the run's own port; across hosts at the launch script's MASTER_ADDR / MASTER_PORT
over the interface toward MASTER_ADDR. Two hosts for real: tests/e2e/test_two_hosts.py."""

from __future__ import annotations

import ipaddress
import os

import pytest

from engine import network
from npu_standin import dist, record
from npu_standin.environment import ENV_MASTER_ADDR, ENV_MASTER_PORT, loopback_name
from npu_standin.errors import StandinError

LAUNCH_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
               "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", ENV_MASTER_ADDR, ENV_MASTER_PORT)


@pytest.fixture
def launch(monkeypatch):
    """The environment a rank starts with: the stand-in's own port, then what the launch script exported."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(record, "NOTES", {})
    monkeypatch.setenv(ENV_MASTER_ADDR, "127.0.0.1")
    monkeypatch.setenv(ENV_MASTER_PORT, "41234")

    def set_env(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
    return set_env


def _own_address() -> tuple[str, str]:
    for name, address in network.interfaces():
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and not ip.is_loopback:
            return name, address
    pytest.skip("this host has no non-loopback IPv4 address")


@pytest.mark.parametrize("world_size, environ, spans", [
    (16, {"LOCAL_WORLD_SIZE": "8"}, True),            # function.sh: 950-class, 8 chips a server
    (32, {"LOCAL_WORLD_SIZE": "16"}, True),           # function.sh: A2/A3, 16 chips a server
    (-1, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, True),   # the world size from the environment
    (16, {"LOCAL_WORLD_SIZE": "16"}, False),
    (2, {"LOCAL_WORLD_SIZE": "2"}, False),             # function.sh on one server: min(chips, world size)
    (2, {}, False),                                    # a launcher that does not say: one host
    (2, {"LOCAL_WORLD_SIZE": "two"}, False),
])
def test_spans_hosts(world_size, environ, spans):
    assert dist.spans_hosts(world_size, environ) is spans


def test_one_host_meets_on_loopback_at_the_runs_own_port(launch):
    _, address = _own_address()
    launch(MASTER_ADDR=address, MASTER_PORT=6038, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)   # function.sh, one server
    dist._rendezvous(None, 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "41234")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_name()
    assert f"{address}:6038" in record.NOTES["rendezvous"]


def test_several_hosts_meet_at_the_launch_scripts_address_over_the_interface_toward_it(launch):
    """Node 0 of upstream's function.sh over two servers: MASTER_ADDR is its own address (IPs[0]); the
    peers reach it there, so gloo binds and advertises the interface that owns it, not loopback."""
    name, address = _own_address()
    launch(MASTER_ADDR=address, MASTER_PORT=6038, WORLD_SIZE=16, LOCAL_WORLD_SIZE=8)
    dist._rendezvous(None, 16)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (address, "6038")
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == (name, f"={name}")
    assert "HCCL_IF_IP" not in record.NOTES["rendezvous"]
    assert f"rendezvous at {address}:6038" in record.NOTES["rendezvous"]
    assert f"interface {name} ({address})" in record.NOTES["rendezvous"]


def test_several_hosts_keep_the_users_interface(launch):
    _, address = _own_address()
    launch(MASTER_ADDR=address, MASTER_PORT=6038, WORLD_SIZE=16, LOCAL_WORLD_SIZE=8, GLOO_SOCKET_IFNAME="bond0")
    dist._rendezvous(None, 16)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "bond0"
    assert "kept GLOO_SOCKET_IFNAME=bond0" in record.NOTES["rendezvous"]


def test_several_hosts_with_a_master_addr_that_does_not_resolve_is_one_line(launch):
    launch(MASTER_ADDR="xx.xx.xx.xx", MASTER_PORT=6038, WORLD_SIZE=32, LOCAL_WORLD_SIZE=16)   # set_env.sh's placeholder
    with pytest.raises(StandinError) as err:
        dist._rendezvous(None, 32)
    assert "\n" not in str(err.value)
    assert "MASTER_ADDR='xx.xx.xx.xx' does not resolve here" in str(err.value)
    assert "the first of set_env.sh's IPs" in str(err.value)


def test_torchrun_keeps_its_rendezvous_and_one_host_binds_loopback(launch):
    launch(MASTER_ADDR="127.0.0.1", MASTER_PORT=29511, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="x")
    dist._rendezvous("env://", 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_name()
