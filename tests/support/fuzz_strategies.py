"""Hypothesis strategies more than one test file draws from: YAML documents of anchors, aliases, nesting and
repeated keys; pieces of hub references (encodings, separators, names)."""

from __future__ import annotations

from hypothesis import strategies as st


SCALARS = st.sampled_from(["1", "x", "'q'", "null", "true", "1.5", "\"\\u00e9\"", "~"])


@st.composite
def yaml_docs(draw):
    """Documents mixing anchors, aliases, nesting and repeated keys in shapes no test lists."""
    anchors: list[str] = []
    lines = []
    for i in range(draw(st.integers(1, 12))):
        depth = draw(st.integers(0, 3))
        kind = draw(st.sampled_from(["anchor_list", "alias_list", "scalar", "dup", "nested"]))
        key = draw(st.sampled_from([f"k{i}", "k0", "dtype"])) if kind == "dup" else f"k{i}"
        if kind == "anchor_list" or (kind == "alias_list" and not anchors):
            name = f"a{i}"
            items = [draw(SCALARS) for _ in range(draw(st.integers(1, 8)))]
            lines.append(f"{key}: &{name} [{', '.join(items)}]")
            anchors.append(name)
        elif kind == "alias_list":
            width = draw(st.integers(1, 30))
            refs = [f"*{draw(st.sampled_from(anchors))}" for _ in range(width)]
            name = f"a{i}"
            lines.append(f"{key}: &{name} [{', '.join(refs)}]")
            anchors.append(name)
        elif kind == "nested":
            lines.append(f"{key}: " + "[" * (depth * 40) + draw(SCALARS) + "]" * (depth * 40))
        else:
            lines.append(f"{key}: {draw(SCALARS)}")
    return "\n".join(lines) + "\n"


PIECES = st.sampled_from(["..", ".", "/", "\\", "%2F", "%2f", "%252F", "%25252F", "%2E", "%2e%2E", "%5C", "%00",
                          "\x00", "\n", "main", "v1", "refs", "pr", "~", "/etc", "C:", "%", "%25", "a", "-", "@{"])
