"""Launch a recipe's infer.py: in-process for world_size 1, torchrun for more ranks.

    python -m engine.launch --yaml-file-path config/x.yaml infer.py

Several machines: the same command on each, with torchrun's settings from the environment (as
infer.sh passes them): NNODES (machines), NODE_RANK (this one, 0..NNODES-1), MASTER_ADDR and
MASTER_PORT (node 0's address and a free port). world_size counts the ranks of all machines:
each starts world_size / NNODES of them. Without NNODES (or NNODES=1): one machine, --standalone.
On several machines the ranks talk over the interface that reaches MASTER_ADDR (engine.network: gloo,
NCCL and HCCL are told which, unless the user's environment names one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from engine.config import ConfigError, load_runner_settings


def torchrun_args(world_size: int, environ: dict) -> list[str]:
    """torchrun's options for `world_size` ranks over NNODES machines (from `environ`)."""
    nnodes = int(environ.get("NNODES") or 1)
    if nnodes < 1 or world_size % nnodes:
        raise ConfigError(f"world_size={world_size} must be a multiple of NNODES={nnodes}")
    if nnodes == 1:
        return ["--standalone", f"--nproc-per-node={world_size}"]
    node_rank = int(environ.get("NODE_RANK") or 0)
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"NODE_RANK={node_rank} must be in 0..{nnodes - 1} (NNODES={nnodes})")
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--master-addr={environ.get('MASTER_ADDR') or '127.0.0.1'}",
            f"--master-port={environ.get('MASTER_PORT') or '29500'}",
            f"--nproc-per-node={world_size // nnodes}"]


def network_environment(world_size: int, environ) -> tuple[dict[str, str], str | None]:
    """The variables that make the ranks of a multi-machine run use the interface toward MASTER_ADDR
    (engine.network), and a line saying so; nothing on one machine. Raises ConfigError where
    MASTER_ADDR does not resolve or has no route from here."""
    from engine import network

    if world_size <= 1 or int(environ.get("NNODES") or 1) <= 1:
        return {}, None
    master = environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        route = network.toward(master)
    except network.NoRoute as exc:
        raise ConfigError(f"{exc}: set MASTER_ADDR to node 0's address, reachable from every machine") from None
    chosen = network.settings(route, environ)
    return chosen, network.describe(route, chosen, environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml-file-path", required=True)
    parser.add_argument("script", help="the recipe's infer.py")
    args = parser.parse_args(argv)
    try:
        from engine.environment import simulated_card_bytes

        simulated_card_bytes()          # a malformed MIGRATOR_DEVICE_MEMORY_BYTES: one line, before any load
        settings = load_runner_settings(args.yaml_file_path)
        world_size = settings["world_size"]
        launch = torchrun_args(world_size, os.environ) if world_size > 1 else []
        network, line = network_environment(world_size, os.environ)
    except (ConfigError, ValueError) as exc:
        print(f"engine.launch: error: {exc}", file=sys.stderr)
        return 2
    if line:
        print(f"engine.launch: {line}", file=sys.stderr)
    os.environ.update(network)          # torchrun's workers inherit it
    script_args = [args.script, "--yaml-file-path", args.yaml_file_path]
    if world_size == 1:
        os.execv(sys.executable, [sys.executable, *script_args])
    torchrun = shutil.which("torchrun")
    runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    os.execv(runner[0], [*runner, *launch, *script_args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
