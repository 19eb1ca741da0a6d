"""engine/logging_utils.py: a recipe's rank writes its log to ${RES_PATH}/log_{rank}.log (what the baseline
collector and the trial run read) and to stdout, once per logger however often it is asked for; without
RES_PATH under res/<date>/<model>/ of the working directory."""

from __future__ import annotations

import logging

from engine.logging_utils import get_logger, res_path


def _drop(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)


def test_each_rank_logs_to_its_own_file_under_res_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RES_PATH", str(tmp_path / "run" / "res"))
    logger = get_logger("m_log_test", rank=1)
    try:
        assert get_logger("m_log_test", rank=1) is logger and len(logger.handlers) == 2
        logger.info("prefill 12.5 ms")
        for handler in logger.handlers:
            handler.flush()
        text = (tmp_path / "run" / "res" / "log_1.log").read_text()
        assert text.endswith("[INFO] prefill 12.5 ms\n") and "prefill 12.5 ms" in capsys.readouterr().out
    finally:
        _drop(logger)


def test_without_res_path_the_folder_is_res_of_the_day_and_model(tmp_path, monkeypatch):
    monkeypatch.delenv("RES_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    path = res_path("m")
    assert path.parts[0] == "res" and path.name == "m" and len(path.parts[1]) == 8 and path.parts[1].isdigit()
