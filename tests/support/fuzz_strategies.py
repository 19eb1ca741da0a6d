"""Hypothesis strategies more than one test file draws from: YAML documents of anchors, aliases, nesting and
repeated keys; pieces of hub references (encodings, separators, names)."""

from __future__ import annotations

from hypothesis import strategies as st


PLAIN = st.sampled_from(["1", "x", "'q'", "null", "true", "1.5", "\"\\u00e9\"", "~"])
# scalars whose type's constructor runs on what was drawn: dates and times of any digits, explicit tags on any
# text, integers of any base and length (the loader answers each with a LoadError or a value, nothing else)
DATES = st.builds(lambda y, m, d, t: f"{y:04d}-{m:02d}-{d:02d}{t}", st.integers(1, 9999), st.integers(0, 99),
                  st.integers(0, 99), st.sampled_from(["", " 25:61:61", "t12:00:00.5-05:00", " 1:2:3"]))
TAGGED = st.builds(lambda tag, text: f"!!{tag} '{text}'", st.sampled_from(["int", "float", "bool", "timestamp",
                                                                           "null", "binary", "str"]),
                   st.text(alphabet="0123456789abcdefx-+.:_ ", max_size=12))
NUMBERS = st.builds(lambda base, n: base + "7" * n, st.sampled_from(["", "-", "0x", "0o", "0b1", "1:"]),
                    st.sampled_from([1, 30, 4299, 4301, 5000]))
SCALARS = st.one_of(PLAIN, DATES, TAGGED, NUMBERS)


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
