"""engine/backends/common.py, what every backend's one-line errors are made of: the root cause of an
exception chain (torch_npu's import failing on libhccl.so, raised from a wrapper), its first non-blank line,
cut to a bound; the first installed distribution of several names."""

from __future__ import annotations

from engine.backends.common import dist_version, exception_chain, first_line, short_error


def test_the_short_error_is_the_root_causes_first_line():
    try:
        try:
            raise OSError("\n  libhccl.so: cannot open shared object file: No such file or directory\nmore")
        except OSError as exc:
            raise ImportError("torch_npu failed to import") from exc
    except ImportError as exc:
        caught = exc
    assert [type(e) for e in exception_chain(caught)] == [ImportError, OSError]
    assert short_error(caught) == "OSError: libhccl.so: cannot open shared object file: No such file or directory"
    assert short_error(RuntimeError("")) == "RuntimeError: (no message)"


def test_first_line_is_bounded_and_a_cycle_ends_the_chain():
    assert first_line("x" * 300, limit=20) == "x" * 17 + "..." and first_line(None) == "" and first_line("\n \n") == ""
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert exception_chain(a) == [a, b]


def test_the_first_installed_distribution_is_found():
    assert dist_version("no-such-distribution-x", "pytest") is not None
    assert dist_version("no-such-distribution-x") is None
