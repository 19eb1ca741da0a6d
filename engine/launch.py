"""Launch a recipe's infer.py: in-process for world_size 1, torchrun for more ranks.

    python -m engine.launch --yaml-file-path config/x.yaml infer.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from engine.config import ConfigError, load_runner_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.launch", description=__doc__)
    parser.add_argument("--yaml-file-path", required=True)
    parser.add_argument("script", help="the recipe's infer.py")
    args = parser.parse_args(argv)
    try:
        settings = load_runner_settings(args.yaml_file_path)
    except ConfigError as exc:
        print(f"engine.launch: error: {exc}", file=sys.stderr)
        return 2
    world_size = settings["world_size"]
    script_args = [args.script, "--yaml-file-path", args.yaml_file_path]
    if world_size == 1:
        os.execv(sys.executable, [sys.executable, *script_args])
    torchrun = shutil.which("torchrun")
    runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    os.execv(runner[0], [*runner, "--standalone", f"--nproc-per-node={world_size}", *script_args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
