"""HCCL on the host: process groups asked for with backend "hccl" are gloo (cpu) or nccl (cuda).

`torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options` exists so that upstream's group code runs;
its `hccl_config` (buffer size, op expansion mode) has no meaning for gloo/nccl and is dropped
with a note naming the values.

Where the ranks meet: on one host, outside torchrun (whose agent owns the rendezvous), on 127.0.0.1 at
the port the launcher chose for this run, whatever MASTER_ADDR / MASTER_PORT the launch script exported
(upstream's function.sh fixes port 6038, which two runs on one host would share), and gloo binds the
loopback interface. Ranks on several hosts (the launch script's LOCAL_WORLD_SIZE below the world size:
upstream's function.sh over its `IPs` list, torchrun --nnodes) meet at the launch script's MASTER_ADDR /
MASTER_PORT, and gloo / nccl use the interface toward MASTER_ADDR (engine/network.py: the address the
host name resolves to, which gloo would advertise, is loopback on many hosts). A GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME the user set is kept.
"""

from __future__ import annotations

import functools
import os
import types

import torch
import torch.distributed as dist

from npu_standin import device as _dev
from npu_standin import record
from npu_standin.engine_files import network
from npu_standin.errors import StandinError
from npu_standin.environment import ENV_MASTER_ADDR, ENV_MASTER_PORT, loopback_name


class ProcessGroupHCCL:
    """Placeholder of torch_npu's ProcessGroupHCCL type (its Options are what upstream uses)."""

    class Options:
        def __init__(self, is_high_priority_stream: bool = False):
            self.hccl_config: dict = {}
            self.is_high_priority_stream = is_high_priority_stream
            self._timeout = None
            self.global_ranks_in_group: list = []
            self.group_id = ""

        def __repr__(self):
            return f"<ProcessGroupHCCL.Options (npu stand-in) hccl_config={self.hccl_config}>"


def host_backend() -> str:
    return "nccl" if _dev.host_type() == "cuda" else "gloo"


def map_backend(backend):
    """"hccl" (or "npu:hccl" in a device:backend list) -> the host's backend."""
    if not isinstance(backend, str):
        return backend
    text = backend.lower()
    if "hccl" not in text:
        return backend
    if ":" in text:
        parts = []
        for item in text.split(","):
            dev, _, name = item.partition(":")
            if name == "hccl" or dev == "npu":
                parts.append(f"{_dev.host_type()}:{host_backend()}")
            else:
                parts.append(item)
        return ",".join(dict.fromkeys(parts))
    return host_backend()


def _drop_options(options, where: str):
    if isinstance(options, ProcessGroupHCCL.Options):
        record.runtime("hccl options dropped")
        config = ", ".join(f"{k}={v}" for k, v in sorted(options.hccl_config.items())) or "none"
        record.note(f"hccl-options:{config}",
                    f"{where}: ProcessGroupHCCL.Options ({config}) have no meaning for {host_backend()}: dropped")
        return None
    return options


def spans_hosts(world_size: int, environ=os.environ) -> bool:
    """Whether some of the ranks run on other hosts: the launch script says how many run on this one
    (LOCAL_WORLD_SIZE: upstream's function.sh and torchrun both export it)."""
    try:
        world = world_size if world_size and world_size > 0 else int(environ.get("WORLD_SIZE") or 1)
        local = int(environ.get("LOCAL_WORLD_SIZE") or 0)
    except ValueError:
        return False
    return 0 < local < world


def _single_host_rendezvous() -> None:
    addr, port = os.environ.get(ENV_MASTER_ADDR), os.environ.get(ENV_MASTER_PORT)
    if not (addr and port):
        return
    before = f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
    if before != f"{addr}:{port}":
        record.note("rendezvous", f"rendezvous {before} (from the launch script) -> {addr}:{port}: "
                                  "stand-in runs on one host meet on loopback, each on a port of its own", echo=False)


def _interface(hosts: bool) -> None:
    """GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on cuda), unless the user set them: loopback on one
    host; on several, the interface toward MASTER_ADDR."""
    if not hosts:
        if host_backend() == "gloo":
            os.environ.setdefault(network.GLOO, loopback_name())
        return
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        route = network.toward(master)
    except network.NoRoute as exc:
        raise StandinError(f"npu stand-in: ranks on several hosts: {exc}: set MASTER_ADDR (upstream's "
                           "function.sh: the first of set_env.sh's IPs) to node 0's address, reachable from "
                           "every host") from None
    keys = (network.GLOO, network.NCCL)       # no HCCL here: the stand-in's HCCL is gloo / nccl
    chosen = {key: value for key, value in network.settings(route, os.environ).items() if key in keys}
    line = network.describe(route, chosen, os.environ, keys)
    os.environ.update(chosen)
    record.note("rendezvous", f"ranks on several hosts (world {os.environ.get('WORLD_SIZE', '?')}, "
                              f"{os.environ.get('LOCAL_WORLD_SIZE')} here): rendezvous at "
                              f"{master}:{os.environ.get('MASTER_PORT', '-')} as the launch script set it; {line}",
                echo=False)


def _rendezvous(init_method, world_size) -> None:
    hosts = spans_hosts(world_size)
    if init_method in (None, "env://") and not os.environ.get("TORCHELASTIC_RUN_ID") and not hosts:
        _single_host_rendezvous()
    _interface(hosts)


def _wrap_init(real):
    @functools.wraps(real)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                           store=None, group_name="", pg_options=None, device_id=None):
        mapped = map_backend(backend)
        if mapped != backend:
            record.runtime(f"hccl->{host_backend()}")
            record.note("hccl", f"init_process_group(backend={backend!r}) runs on {mapped}", echo=False)
        pg_options = _drop_options(pg_options, "init_process_group")
        if device_id is not None and _dev.needs_map(device_id):
            device_id = _dev.map_device(device_id)
        if isinstance(device_id, torch.device) and device_id.type == "cpu":
            device_id = None          # gloo binds no device
        if store is None:
            _rendezvous(init_method, world_size)
        else:
            _interface(spans_hosts(world_size))
        kwargs = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        return real(backend=mapped, init_method=init_method, world_size=world_size, rank=rank, store=store,
                    group_name=group_name, pg_options=pg_options, device_id=device_id, **kwargs)

    return init_process_group


def _wrap_new_group(real):
    @functools.wraps(real)
    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        mapped = map_backend(backend)
        if mapped != backend:
            record.runtime(f"hccl->{host_backend()}")
        pg_options = _drop_options(pg_options, "new_group")
        return real(ranks, timeout, mapped, pg_options, *args, **kwargs)

    return new_group


def _hccl_available() -> bool:
    return True


_installed = {"done": False}


def install() -> None:
    if _installed["done"] or not dist.is_available():
        return
    _installed["done"] = True
    from npu_standin.patches import replace

    for attr, wrap in (("init_process_group", _wrap_init), ("new_group", _wrap_new_group)):
        wrapped = replace(dist, attr, wrap)
        replace(dist.distributed_c10d, attr, lambda real, wrapped=wrapped: wrapped)
    replace(dist, "is_hccl_available", lambda real: _hccl_available)
    _comm_names()


def _comm_names() -> None:
    """ProcessGroupHCCL.get_hccl_comm_name(rank) on the host's backend: upstream passes the name to the
    MC2 / EP kernels (npu_moe_distribute_dispatch_v2, ...) as `group_ep`, and their references
    (kernels/mc2.py) turn it back into the process group (`process_group_named`) to run their
    all-to-all on it."""
    import torch._C._distributed_c10d as c10d

    def get_hccl_comm_name(self, rank):
        record.runtime("get_hccl_comm_name")
        return comm_name(self)

    for name in ("ProcessGroupGloo", "ProcessGroupNCCL"):
        cls = getattr(c10d, name, None)
        if cls is not None and not hasattr(cls, "get_hccl_comm_name"):
            cls.get_hccl_comm_name = get_hccl_comm_name


_named: dict = {}      # comm name -> its backend, held so that the name stays its own (ids are reused)


def comm_name(backend) -> str:
    """The HCCL communicator name the stand-in gives a host backend (ProcessGroupGloo / NCCL): unique in
    this process, as HCCL's names are (each rank asks its own)."""
    for name, known in _named.items():
        if known is backend:
            return name
    name = f"npu-standin-{host_backend()}-{id(backend):x}"
    _named[name] = backend
    return name


def hccl_comm_name(group=None) -> str:
    """`group._get_backend(npu).get_hccl_comm_name(rank)` as upstream's executor/utils/hccl_utils.py asks it,
    for a process group of this process (default: the world group)."""
    group = group if group is not None else dist.group.WORLD
    return comm_name(group._get_backend(torch.device(_dev.host_type())))


def process_group_named(name: str):
    """The process group whose backend get_hccl_comm_name gave `name` in this process, or None."""
    from torch.distributed.distributed_c10d import _world

    backend = _named.get(name)
    if backend is None:
        return None
    device = torch.device(_dev.host_type())
    for group in list(_world.pg_map):
        try:
            if group._get_backend(device) is backend:
                return group
        except RuntimeError:
            continue
    return None


def c10d_module() -> types.ModuleType:
    module = types.ModuleType("torch_npu._C._distributed_c10d")
    module.ProcessGroupHCCL = ProcessGroupHCCL
    module.__npu_standin__ = True
    return module
