"""Two hosts on one machine: network namespaces joined by a veth pair, each host's commands in a pid
namespace of its own (as on two servers: upstream's launcher sees only its own host's processes).

The addresses are private to the pair (10.231.44.1/30 and .2/30): namespaces of other tests never see
them. Both hosts share the machine's host name and /etc/hosts, so the name resolves to a loopback address
on each, as it does on many hosts (127.0.0.1 here, 127.0.1.1 on Debian's default /etc/hosts): a
collective library that advertises the address its host name resolves to is refused by the peer.
Network namespaces need root (CAP_SYS_ADMIN); where `ip netns add` is refused the test is skipped with
the refusal's line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ADDRESSES = ("10.231.44.1", "10.231.44.2")
PREFIX = 30


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host: in its network namespace, in a pid namespace (and /proc) of its own.
        --kill-child: when the command's process is killed, the namespace's processes go with it."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--pid", "--fork", "--mount-proc",
                "--kill-child", *argv]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)


def _first_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[0] if lines else f"exit {proc.returncode}"


@contextmanager
def two_hosts():
    """Yields (host0, host1); the namespaces (and with them the veth pair) are removed however it ends."""
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"two hosts need iproute2's `ip` and util-linux's `unshare`: {', '.join(missing)} not on PATH here")
    tag = uuid.uuid4().hex[:6]
    hosts = tuple(Host(f"mig-{tag}-h{i}", f"mig{tag}v{i}", ADDRESSES[i]) for i in range(2))
    made: list[str] = []
    try:
        for host in hosts:
            proc = _ip("netns", "add", host.namespace)
            if proc.returncode != 0:
                pytest.skip(f"`ip netns add` is refused here: {_first_line(proc)}")
            made.append(host.namespace)
        steps = [("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)]
        for host in hosts:
            steps += [("link", "set", host.interface, "netns", host.namespace),
                      ("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX}", "dev", host.interface),
                      ("-n", host.namespace, "link", "set", host.interface, "up"),
                      ("-n", host.namespace, "link", "set", "lo", "up")]
        for step in steps:
            proc = _ip(*step)
            if proc.returncode != 0:
                if step[0] == "link" and step[1] == "add":
                    pytest.skip(f"`ip link add … type veth` is refused here: {_first_line(proc)}")
                raise RuntimeError(f"ip {' '.join(step)}: {_first_line(proc)}")
        yield hosts
    finally:
        for namespace in made:
            _ip("netns", "delete", namespace)
        # the veth pair goes with its namespaces; one left in this namespace by a failed move does not
        for host in hosts:
            if _ip("link", "show", host.interface).returncode == 0:
                _ip("link", "delete", host.interface)


@dataclass
class Node:
    process: subprocess.Popen
    log: Path

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def start(host: Host, argv: list[str], log: Path, **popen) -> Node:
    """`argv` on `host`, its output (stdout and stderr) to the file `log` (a pipe nobody reads while the
    run goes on would fill and stop it)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(host.command(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, **popen)
    return Node(process, Path(log))


def finish(nodes: list[Node], timeout: float, grace: float = 20) -> tuple[list[str], bool]:
    """(every node's output, whether the time ran out). The nodes still running are killed (with them
    their pid namespaces) at `timeout` seconds from now, `grace` seconds after one of them failed (its
    peers would wait for it until the library's own timeout), or on any error."""
    import time

    deadline, timed_out = time.monotonic() + timeout, False
    try:
        while any(node.process.poll() is None for node in nodes):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(node.process.poll() not in (None, 0) for node in nodes):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.5)
    finally:
        for node in nodes:
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()
    return [node.log.read_text(errors="replace") for node in nodes], timed_out
