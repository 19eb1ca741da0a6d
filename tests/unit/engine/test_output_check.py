"""engine/output_check.py, the check that a run printed readable text: English and Chinese pass, repetition and
random bytes fail, the length limits hold."""

from __future__ import annotations

import random

from engine.output_check import check_output_text


def test_output_check_normal_english():
    text = ("The capital of France is Paris. It is located on the Seine river and is known "
            "for the Eiffel Tower, the Louvre museum, and its many cafes. About two million "
            "people live in the city itself.")
    res = check_output_text(text)
    assert res["ok"] is True, res
    assert res["reasons"] == []
    assert res["chars"] == len(text)
    assert res["printable_share"] == 1.0
    assert res["word_like_share"] >= 0.9
    assert res["repeated_ngram_share"] < 0.1


def test_output_check_chinese_passes():
    res = check_output_text("法国的首都是巴黎。巴黎位于塞纳河畔，以埃菲尔铁塔和卢浮宫闻名于世。")
    assert res["ok"] is True, res


def test_output_check_repetitive_fails():
    res = check_output_text(" ".join(["the"] * 50))
    assert res["ok"] is False
    assert res["repeated_ngram_share"] > 0.9
    assert any("repetitive" in r for r in res["reasons"])


def test_output_check_repetitive_without_spaces_fails():
    res = check_output_text("你好世界" * 30)
    assert res["ok"] is False
    assert any("character 8-grams" in r for r in res["reasons"])


def test_output_check_random_bytes_fail():
    rng = random.Random(0)
    garbage = bytes(rng.randrange(256) for _ in range(400)).decode("latin-1")
    res = check_output_text(garbage)
    assert res["ok"] is False
    assert res["printable_share"] < 0.95
    assert any("unreadable" in r for r in res["reasons"])

    res = check_output_text("\x00\x01\x02\x1b[0m\x7f" * 20)
    assert res["ok"] is False and any("unreadable" in r for r in res["reasons"])


def test_output_check_empty_and_length_limits():
    res = check_output_text("")
    assert res["ok"] is False and res["chars"] == 0 and res["reasons"]
    assert check_output_text("Hi there", min_chars=20)["ok"] is False
    assert check_output_text("word " * 10, max_chars=20)["ok"] is False
