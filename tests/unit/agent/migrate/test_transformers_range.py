"""agent/migrate/transformers_range.py, what the installed transformers can build: below a row's version its
model_type is refused, at or above it is not."""

from __future__ import annotations


def test_transformers_range_rows():
    """The refusal table: below a row's version its model_type is refused, at or above it is not."""
    from agent.migrate.transformers_range import ROWS, needed_version

    for row in ROWS:
        assert needed_version(row.model_type, "5.0.0") is row
        assert needed_version(row.model_type, row.version) is None
        assert needed_version(row.model_type, "5.24.0") is None
    assert needed_version("llama", "5.0.0") is None
