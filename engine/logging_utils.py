"""Per-rank log files: ${RES_PATH}/log_{rank}.log, default res/{date}/{model_name}/."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from engine.safe_write import UserTree, run_folder_tree


LOG_FORMAT = "[%(asctime)s] [%(levelname)s] %(message)s"


def res_path(model_name: str) -> Path:
    default = Path("res") / time.strftime("%Y%m%d") / model_name
    return Path(os.environ.get("RES_PATH") or default)


def get_logger(model_name: str, rank: int = 0) -> logging.Logger:
    """Logger writing to stdout and to ${RES_PATH}/log_{rank}.log (created on demand)."""
    logger = logging.getLogger(f"engine.{model_name}.{rank}")
    if logger.handlers:
        return logger
    logger.setLevel(logging.INFO)
    logger.propagate = False
    out_dir = res_path(model_name)
    # RES_PATH: the run folder the launcher named; else res/ under the recipe, nothing through a link out of it
    tree = run_folder_tree(out_dir, create=True) if os.environ.get("RES_PATH") else UserTree(Path.cwd())
    tree.mkdir(out_dir)
    formatter = logging.Formatter(LOG_FORMAT)
    log_file = tree.open(out_dir / f"log_{rank}.log", "a")
    for handler in (logging.StreamHandler(log_file), logging.StreamHandler(sys.stdout)):

        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger
