"""Per-rank log files: ${RES_PATH}/log_{rank}.log, default res/{date}/{model_name}/."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

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
    out_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.FileHandler(out_dir / f"log_{rank}.log"), logging.StreamHandler(sys.stdout)):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger
