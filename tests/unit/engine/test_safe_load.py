"""engine/safe_load.py is the one loader for every YAML and JSON file (SPEC §6): bounded aliases, depth,
size and nodes; duplicate keys refused; bytes that are not UTF-8 named; every refusal one line with file
and line (the walk that fails on any direct load elsewhere: tests/lint/test_loads_through_safe_load.py). A
small hypothesis pass builds documents the tests never list (bomb shapes, depths, encodings)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.safe_load import (JSON_MAX_BYTES, LoadError, load_json, load_yaml, loads_json, loads_yaml,
                              read_capped)
from fuzz_strategies import yaml_docs


# ---- bounds --------------------------------------------------------------------------------------
def bomb(levels: int, width: int, key: str = "config_overrides") -> str:
    """A billion-laughs document of `levels` levels of `width` aliases under model_config.<key>."""
    names = [f"l{i}" for i in range(levels)]
    lines = ["model_name: x", "model_config:", f"  {key}:", f"    {names[0]}: &{names[0]} [{', '.join(['ha'] * width)}]"]
    for prev, name in zip(names, names[1:]):
        lines.append(f"    {name}: &{name} [{', '.join(['*' + prev] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels, width", [(9, 9), (6, 20), (20, 3), (4, 40)])
def test_alias_bombs_are_refused_before_anything_is_built(levels, width):
    doc = bomb(levels, width)
    start = time.perf_counter()
    with pytest.raises(LoadError) as info:
        loads_yaml(doc, "config/x.yaml")
    assert time.perf_counter() - start < 2
    assert "expands to more than" in str(info.value) and "config/x.yaml" in str(info.value)
    assert info.value.line is not None and "\n" not in str(info.value)


def test_ordinary_aliases_still_load():
    data = loads_yaml("base: &b {dtype: float32, n: 1}\nmodel_config:\n  <<: *b\n  other: *b\n")
    assert data["model_config"]["dtype"] == "float32" and data["model_config"]["other"] == {"dtype": "float32", "n": 1}


@pytest.mark.parametrize("doc, says", [
    ("a: &a [*a]\n", "recursive"),
    ("a: &a {b: *a}\n", "recursive"),
    ("model_config:\n  dtype: float16\n  dtype: float32\n", "duplicate key 'dtype'"),
    ("a: 1\nb: {x: 1, x: 2}\n", "duplicate key 'x'"),
    ("[" * 150 + "]" * 150, "nested deeper"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 130)), "nested deeper"),
    ("x: !!python/object/apply:os.system ['touch PWNED']\n", "not valid YAML"),
    ("x: \x1b[31m\n", "not allowed"),
])
def test_bad_yaml_is_one_line_with_file_and_line(doc, says):
    with pytest.raises(LoadError) as info:
        loads_yaml(doc, "f.yaml")
    text = str(info.value)
    assert says in text and text.startswith("f.yaml: ") and "\n" not in text
    assert not Path("PWNED").exists()


def test_depth_through_aliases_is_bounded():
    doc = "a: &a " + "[" * 60 + "]" * 60 + "\nb: &b " + "[" * 30 + "*a" + "]" * 30 + "\nc: " + "[" * 30 + "*b" + "]" * 30
    with pytest.raises(LoadError, match="nested deeper"):
        loads_yaml(doc)


@pytest.mark.parametrize("raw, line", [(b"a: 1\nb: \xff\n", 2), (b"\n\n\nname: caf\xe9\n", 4),
                                       (b"a: \xe4\xb8\n", 1), (b"\x00\x01binary\x9c", 1)])
def test_bytes_that_are_not_utf8_are_named(tmp_path, raw, line):
    path = tmp_path / "x.yaml"
    path.write_bytes(raw)
    with pytest.raises(LoadError) as info:
        load_yaml(path)
    assert "not UTF-8" in str(info.value) and f"line {line}" in str(info.value) and str(path) in str(info.value)
    assert info.value.kind == "encoding"


@pytest.mark.parametrize("text, says", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"x": {"inner": 1,\n "inner": 2}}', "duplicate key 'inner' at line 2"),
    ("[" * 500 + "]" * 500, "nested deeper"),
    ('{"a": [1, 2', "not valid JSON"),
    ('{"a": NaN}', "NaN is not a JSON number"),
])
def test_bad_json_is_one_line(text, says):
    with pytest.raises(LoadError) as info:
        loads_json(text, "c.json", allow_nan=False)
    assert says in str(info.value) and str(info.value).startswith("c.json: ")


def test_size_is_capped_before_reading(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(64 * 2**20)          # sparse: costs nothing, would be 64 MiB to read
    with pytest.raises(LoadError, match="larger than"):
        load_yaml(big)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(LoadError, match="not a regular file"):
        load_json(fifo)                 # never blocks on the FIFO
    with pytest.raises(LoadError, match="not a regular file"):
        read_capped("/dev/zero", JSON_MAX_BYTES)


def test_load_error_is_caught_by_the_handlers_callers_had():
    with pytest.raises(yaml.YAMLError):
        loads_yaml("a: [")
    with pytest.raises(ValueError):
        loads_json("{")


# ---- fuzz (bounded: a few seconds in the default suite) --------------------------------------------
def _expanded(value, seen_depth=0) -> tuple[int, int]:
    """(nodes, depth) of a loaded value walked as a consumer would (json.dumps, deepcopy)."""
    stack, nodes, depth = [(value, 1)], 0, 0
    while stack:
        item, d = stack.pop()
        nodes += 1
        depth = max(depth, d)
        if nodes > 2_000_000:
            return nodes, depth
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
            stack.extend((k, d + 1) for k in item)
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return nodes, depth


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(yaml_docs())
def test_fuzz_whatever_loads_is_bounded(doc):
    try:
        data = loads_yaml(doc, "fuzz.yaml")
    except LoadError as exc:
        assert str(exc).startswith("fuzz.yaml: ") and "\n" not in str(exc)
        return
    nodes, depth = _expanded(data)
    assert nodes <= 1_000_000 and depth <= 101, (nodes, depth)
    json.dumps(data, default=str)       # what the parity child did with config_overrides: bounded now
    str(data)                           # every value prints (an integer past Python's digit limit would not)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=3), kids, max_size=4),
                    max_leaves=30),
       st.sampled_from(["utf-8", "utf-16", "latin-1", "gb18030"]), st.booleans())
def test_fuzz_json_round_trips_or_refuses_in_one_line(value, encoding, dup):
    text = json.dumps(value, ensure_ascii=False)
    if dup and text.startswith("{") and len(text) > 2:
        text = '{"dup": 1, "dup": 2, ' + text[1:]
    raw = text.encode(encoding, errors="replace")
    try:
        got = loads_json(raw, "fuzz.json")
    except LoadError as exc:
        assert str(exc).startswith("fuzz.json: ") and "\n" not in str(exc)
        assert exc.kind in ("encoding", "duplicate", "syntax", "bound"), exc.kind
        if exc.kind == "duplicate":
            assert dup
        return
    assert got == json.loads(raw.decode("utf-8")) and not (dup and text.startswith('{"dup"'))


# ---- archives: --transformers-source wheels, member by member -------------------------------------------
INIT = b'__version__ = "5.3.1"\n'


def _wheel(path: Path, members: dict[str, bytes | int], init: bytes | int = INIT) -> Path:
    """A wheel whose members are bytes, or an int: that many zero bytes, streamed (never held in memory)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in {"transformers/__init__.py": init, **members}.items():
            if isinstance(data, int):
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(info, "w", force_zip64=data >= 2**31) as sink:
                    block = bytes(2**22)
                    for start in range(0, data, len(block)):
                        sink.write(block[: min(len(block), data - start)])
            else:
                archive.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def gib_of_zeros(tmp_path_factory) -> Path:
    return _wheel(tmp_path_factory.mktemp("bomb") / "transformers-5.3.1-py3-none-any.whl",
                  {"transformers/zeros.py": 2**30})


def _open(wheel: Path, cache: Path, monkeypatch):
    from agent.migrate.transformers_source import open_source

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return open_source(wheel)


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []


def test_a_small_wheel_of_a_gib_of_zeros_is_refused_without_unpacking(gib_of_zeros, tmp_path, monkeypatch):
    from agent.migrate.transformers_source import BadTransformersSource

    import tracemalloc

    assert gib_of_zeros.stat().st_size < 2 * 2**20
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(BadTransformersSource, match="unpacks to 1073741824 bytes"):
        _open(gib_of_zeros, tmp_path / "cache", monkeypatch)
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 5 and peak < 50 * 2**20, (seconds, peak)
    assert _cache_files(tmp_path / "cache") == []


def _lying(tmp_path: Path) -> Path:
    """A member whose headers claim 100 bytes but whose stream inflates to 16 MiB."""
    import struct

    wheel = _wheel(tmp_path / "lie.whl", {"transformers/lie.py": 16 * 2**20})
    data = bytearray(wheel.read_bytes())
    name = b"transformers/lie.py"
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = data.find(sig + b"")
        while at >= 0:
            name_len_at = 26 if sig == b"PK\x03\x04" else 28
            name_len = struct.unpack_from("<H", data, at + name_len_at)[0]
            head = 30 if sig == b"PK\x03\x04" else 46
            if bytes(data[at + head: at + head + name_len]) == name:
                struct.pack_into("<I", data, at + size_at, 100)
            at = data.find(sig, at + 4)
    wheel.write_bytes(bytes(data))
    return wheel


@pytest.mark.parametrize("case, says", [
    ("init_of_a_gib", "unpacks to"),
    ("out_of_range_version", "outside the supported range"),
    ("dotdot_member", "not a plain relative path"),
    ("absolute_member", "not a plain relative path"),
    ("backslash_member", "not a plain relative path"),
    ("symlink_member", "not a regular file"),
    ("lying_sizes", "damaged"),
    ("not_a_zip", "not a wheel"),
    ("total_too_large", "unpacks to"),
])
def test_bad_wheels_are_refused_and_leave_nothing_in_the_cache(case, says, tmp_path, monkeypatch):
    import zipfile

    from agent.migrate.transformers_source import BadTransformersSource

    wheel = tmp_path / "w.whl"
    if case == "init_of_a_gib":
        _wheel(wheel, {}, init=2**30 // 8)
    elif case == "out_of_range_version":
        _wheel(wheel, {"transformers/big.py": 8 * 2**20}, init=b'__version__ = "4.57.0"\n')
    elif case in ("dotdot_member", "absolute_member", "backslash_member"):
        name = {"dotdot_member": "transformers/../../evil.py", "absolute_member": "transformers//etc/x",
                "backslash_member": "transformers/..\\..\\x.py"}[case]
        _wheel(wheel, {name: b"x = 1\n"})
    elif case == "symlink_member":
        _wheel(wheel, {})
        with zipfile.ZipFile(wheel, "a") as archive:
            info = zipfile.ZipInfo("transformers/link.py")
            info.external_attr = (0o120777 << 16)
            archive.writestr(info, "/etc/passwd")
    elif case == "lying_sizes":
        wheel = _lying(tmp_path)
    elif case == "not_a_zip":
        wheel.write_bytes(b"PK\x03\x04" + os.urandom(2000))
    else:
        _wheel(wheel, {f"transformers/m{i}.py": 30 * 2**20 for i in range(18)})
    with pytest.raises(BadTransformersSource) as info:
        _open(wheel, tmp_path / "cache", monkeypatch)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert _cache_files(tmp_path / "cache") == []
    assert not (tmp_path / "evil.py").exists() and not Path("/etc/x").exists()


def test_a_good_wheel_still_unpacks_every_member(tmp_path, monkeypatch):
    wheel = _wheel(tmp_path / "transformers-5.3.1-py3-none-any.whl",
                   {"transformers/models/llama/modeling_llama.py": b"class LlamaForCausalLM: pass\n",
                    "transformers-5.3.1.dist-info/METADATA": b"Name: transformers\n"})
    tree = _open(wheel, tmp_path / "cache", monkeypatch)
    assert tree.version == "5.3.1" and tree.module_file("transformers.models.llama.modeling_llama") is not None
    assert not (tree.root / "transformers-5.3.1.dist-info").exists()


# ---- a MemoryError is the model's only when the model's run raised it --------------------------------------
def _traceback(*frames: str) -> str:
    lines = ["Traceback (most recent call last):"]
    for i, frame in enumerate(frames):
        lines += [f'  File "{frame}", line {10 + i}, in f{i}', "    x = y"]
    return "\n".join(lines + ["MemoryError", ""])


@pytest.mark.parametrize("innermost, oom", [
    ("/venv/lib/python3.11/site-packages/yaml/composer.py", False),
    ("/venv/lib/python3.11/site-packages/yaml/constructor.py", False),
    ("/usr/lib/python3.11/json/decoder.py", False),
    ("/usr/lib/python3.11/copy.py", False),
    ("/recipe/engine/config.py", False),
    ("/venv/lib/python3.11/site-packages/tokenizers/__init__.py", False),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", True),
    ("/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py", True),
    ("/recipe/engine/model_runner.py", True),
    ("/recipe/models/modeling_x.py", True),
])
def test_a_memory_error_is_out_of_memory_only_from_the_models_run(tmp_path, innermost, oom):
    from agent.repair.diagnose import diagnose

    out = tmp_path / "output.txt"
    out.write_text(_traceback("/recipe/infer.py", "/recipe/engine/launch.py", innermost))
    got = diagnose(tmp_path, {"output_file": str(out)})
    assert bool(got.get("oom")) is oom and (got.get("rule") == "out_of_memory") is oom, got
