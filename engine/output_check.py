"""Cheap sanity checks on a model's generated text (pure Python, no torch).

The baseline collector uses :func:`check_output_text` to say whether the text a
recipe produced looks like language: readable (printable characters, word-like
tokens), not stuck in a loop (repeated n-grams) and of a reasonable length. It
is a smoke test, not a quality metric: passing it says nothing about accuracy.
"""

from __future__ import annotations

import string

__all__ = ["check_output_text"]

MIN_PRINTABLE_SHARE = 0.95
MIN_WORD_LIKE_SHARE = 0.5
MAX_REPEATED_NGRAM_SHARE = 0.5
MIN_WORDS_FOR_WORD_NGRAMS = 10
WORD_NGRAM = 3
CHAR_NGRAM = 8
MIN_CHAR_NGRAMS = 10
# Mean non-space characters per whitespace-separated token above which the text
# is treated as "few spaces" (Chinese, Japanese, ...) and char n-grams are used.
FEW_SPACES_MEAN_TOKEN_LEN = 12
MIN_TOKEN_ALNUM_SHARE = 0.6

# Punctuation a word may carry at its ends ("(word),", "“quoted”", "句子。").
_LIGHT_PUNCT = string.punctuation + "“”‘’«»…—–·、，。！？：；（）【】《》「」『』"
_ALLOWED_CONTROLS = frozenset("\n\t\r")
_REPLACEMENT_CHAR = "\ufffd"


def _is_printable(ch: str) -> bool:
    if ch in _ALLOWED_CONTROLS:
        return True
    if ch == _REPLACEMENT_CHAR:  # what undecodable bytes turn into
        return False
    return ch.isprintable()


def _is_word_like(token: str) -> bool:
    """Letters/digits with light punctuation: "word", "(e.g.", "3.14", "你好，世界。"."""
    core = token.strip(_LIGHT_PUNCT)
    if not core:
        return False
    if any(not _is_printable(ch) for ch in core):
        return False
    alnum = sum(1 for ch in core if ch.isalnum())
    return alnum > 0 and alnum / len(core) >= MIN_TOKEN_ALNUM_SHARE


def _repeated_share(items: list) -> float:
    """1 - distinct/total ("rep-n"): 0.0 for no repeats, near 1.0 for a loop."""
    if not items:
        return 0.0
    return 1.0 - len(set(items)) / len(items)


def _repeated_ngram_share(text: str, words: list[str]) -> tuple[float, str]:
    non_space = sum(len(w) for w in words)
    few_spaces = not words or non_space / len(words) > FEW_SPACES_MEAN_TOKEN_LEN
    if len(words) >= MIN_WORDS_FOR_WORD_NGRAMS and not few_spaces:
        grams = [tuple(words[i:i + WORD_NGRAM]) for i in range(len(words) - WORD_NGRAM + 1)]
        return _repeated_share(grams), f"word {WORD_NGRAM}-grams"
    compact = "".join(words)
    grams = [compact[i:i + CHAR_NGRAM] for i in range(len(compact) - CHAR_NGRAM + 1)]
    if len(grams) < MIN_CHAR_NGRAMS:
        return 0.0, "too short to judge"
    return _repeated_share(grams), f"character {CHAR_NGRAM}-grams"


def check_output_text(text: str, min_chars: int = 1, max_chars: int = 20000) -> dict:
    """Judge whether ``text`` looks like readable, non-degenerate model output.

    Returns ``{"ok", "chars", "printable_share", "word_like_share",
    "repeated_ngram_share", "reasons"}``; ``reasons`` lists every failed check
    (empty when ``ok``). Shares are rounded to 3 decimals.
    """
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, not {type(text).__name__}")

    chars = len(text)
    reasons: list[str] = []

    if chars == 0:
        return {
            "ok": False, "chars": 0, "printable_share": 0.0, "word_like_share": 0.0,
            "repeated_ngram_share": 0.0, "reasons": ["empty text"],
        }
    if chars < min_chars:
        reasons.append(f"too short: {chars} characters < min_chars {min_chars}")
    if chars > max_chars:
        reasons.append(f"too long: {chars} characters > max_chars {max_chars}")

    printable_share = sum(1 for ch in text if _is_printable(ch)) / chars
    if printable_share < MIN_PRINTABLE_SHARE:
        reasons.append(
            f"unreadable: printable share {printable_share:.3f} < {MIN_PRINTABLE_SHARE} "
            "(control characters or undecodable bytes)")

    words = text.split()
    word_like_share = (sum(1 for w in words if _is_word_like(w)) / len(words)) if words else 0.0
    if word_like_share < MIN_WORD_LIKE_SHARE:
        reasons.append(
            f"unreadable: word-like token share {word_like_share:.3f} < {MIN_WORD_LIKE_SHARE}")

    repeated, unit = _repeated_ngram_share(text, words)
    if repeated > MAX_REPEATED_NGRAM_SHARE:
        reasons.append(
            f"repetitive: repeated {unit} share {repeated:.3f} > {MAX_REPEATED_NGRAM_SHARE}")

    return {
        "ok": not reasons,
        "chars": chars,
        "printable_share": round(printable_share, 3),
        "word_like_share": round(word_like_share, 3),
        "repeated_ngram_share": round(repeated, 3),
        "reasons": reasons,
    }
