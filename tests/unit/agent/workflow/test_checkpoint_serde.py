"""The `--resume` checkpoint store is data, never code.

A tampered `.migrator/checkpoints.sqlite` that names `os.system` in a langgraph msgpack extension
(what langgraph's default serializer rebuilds on read) is refused with one line and exit 2; the
store's own serializer round-trips the workflow state and survives a real interrupted graph.
"""

from __future__ import annotations

import json
import operator
import sqlite3
from pathlib import Path
from typing import Annotated, TypedDict

import pytest

from migrator_cli import run_cli

from agent.workflow.checkpoint_serde import FORMAT, StateSerializer, UnsafeStoreError


def _fake_recipe(tmp_path):
    recipe = tmp_path / "rec"
    recipe.mkdir()
    (recipe / "infer.sh").write_text("echo should-not-run >&2\nexit 1\n")
    return recipe


def _register_thread(recipe, out, thread_id="evil-thread"):
    from agent.workflow.run import thread_key

    key = thread_key({"target": str(recipe), "name": None, "output_dir": str(out)})
    (recipe / ".migrator").mkdir(exist_ok=True)
    (recipe / ".migrator" / "threads.json").write_text(json.dumps({key: thread_id}))
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def _put_checkpoint(db, config, channel_values, serde=None):
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(str(db), check_same_thread=False)
    saver = SqliteSaver(conn, serde=serde) if serde else SqliteSaver(conn)
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = channel_values
    checkpoint["channel_versions"] = {k: 1 for k in channel_values}
    saved = saver.put(config, checkpoint, {"source": "loop", "step": 1}, checkpoint["channel_versions"])
    return conn, saved


def _tamper(conn, marker):
    """Rewrite the stored checkpoint so that reading it with langgraph's default serializer calls
    os.system("touch MARKER") (msgpack ext 1 = constructor with positional args)."""
    import ormsgpack

    type_, blob = conn.execute("SELECT type, checkpoint FROM checkpoints").fetchone()
    assert type_ == "msgpack"
    data = ormsgpack.unpackb(blob)
    payload = ormsgpack.Ext(1, ormsgpack.packb(["os", "system", [f"touch {marker}"]]))
    data["channel_values"]["target"] = payload
    conn.execute("UPDATE checkpoints SET checkpoint = ?", (ormsgpack.packb(data),))
    conn.commit()


def _one_error_line(proc):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("migrator: error: "), proc.stderr[-2000:]
    return lines[0]


def test_tampered_store_naming_os_system_is_refused_and_runs_nothing(tmp_path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    recipe, out = _fake_recipe(tmp_path), tmp_path / "out"
    config = _register_thread(recipe, out)
    db = recipe / ".migrator" / "checkpoints.sqlite"
    conn, saved = _put_checkpoint(db, config, {"target": "placeholder"})
    live_marker = tmp_path / "proof_the_payload_is_live"
    _tamper(conn, live_marker)
    # The payload is real: langgraph's default serializer runs it (this is what --resume did before).
    SqliteSaver(conn).get_tuple(saved)
    assert live_marker.exists()
    live_marker.unlink()
    conn.execute("UPDATE checkpoints SET checkpoint = CAST(replace(CAST(checkpoint AS TEXT), "
                 "'proof_the_payload_is_live', 'marker_resume_ran_it') AS BLOB)")
    conn.commit()
    conn.close()

    proc = run_cli("run", str(recipe), "--resume", "--output-dir", str(out), cwd=tmp_path)
    line = _one_error_line(proc)
    assert proc.returncode == 2, proc.stderr
    assert "checkpoints.sqlite" in line and "rm " in line and "without --resume" in line
    assert not (tmp_path / "marker_resume_ran_it").exists() and not live_marker.exists()
    assert "should-not-run" not in proc.stderr


@pytest.mark.parametrize("case", ["not_sqlite", "threads_not_json", "wrong_state_type", "wrong_record_type",
                                  "threads_symlink"])
def test_unreadable_store_is_one_line_exit_2(tmp_path, case):
    recipe, out = _fake_recipe(tmp_path), tmp_path / "out"
    config = _register_thread(recipe, out)
    db = recipe / ".migrator" / "checkpoints.sqlite"
    if case == "not_sqlite":
        db.write_bytes(b"\x00garbage, not a database" * 100)
    elif case == "threads_symlink":     # would be rewritten through the link by a fresh thread
        victim = tmp_path / "victim.json"
        victim.write_text("{}")
        (recipe / ".migrator" / "threads.json").unlink()
        (recipe / ".migrator" / "threads.json").symlink_to(victim)
    elif case == "threads_not_json":
        (recipe / ".migrator" / "threads.json").write_text("[1, 2")
    elif case == "wrong_record_type":   # a run record whose verdict is not a bool
        conn, _ = _put_checkpoint(db, config, {"target": str(recipe), "runs": [{"ok": "rm -rf /"}]}, StateSerializer())
        conn.close()
    else:   # valid JSON data of the wrong shape: rounds must be a list
        conn, _ = _put_checkpoint(db, config, {"target": str(recipe), "rounds": "rm -rf /"}, StateSerializer())
        conn.close()
    proc = run_cli("run", str(recipe), "--resume", "--output-dir", str(out), cwd=tmp_path)
    line = _one_error_line(proc)
    assert proc.returncode == 2 and "rm " in line, proc.stderr
    if case == "threads_symlink":
        assert (tmp_path / "victim.json").read_text() == "{}"
    # the advice, followed: "run without --resume" only where a fresh run never reads the fault (the resumed
    # run's state); the store's own files meet a fresh run too, so there only their removal is advised
    fresh = run_cli("run", str(recipe), "--output-dir", str(out), "--max-rounds", "0", cwd=tmp_path)
    assert ("cannot be read safely" not in fresh.stderr) == ("without --resume" in line), (line, fresh.stderr[-1500:])
    removed = line.split("(rm ", 1)[1].split(")", 1)[0].removeprefix("-r ")
    Path(removed).unlink()
    again = run_cli("run", str(recipe), "--resume", "--output-dir", str(out), "--max-rounds", "0", cwd=tmp_path)
    assert "cannot be read safely" not in again.stderr, again.stderr[-1500:]


# ---- the serializer, in process ---------------------------------------------------------------
STATE = {"target": "Org/Name", "name": None, "max_rounds": 5, "trust_remote_code": False, "env": {"device": "cpu",
         "num_cards": 1, "ratio": 0.5}, "runs": [{"ok": False, "seconds": 1.25, "summary": "KeyError: 'x'"}],
         "rounds": [{"round": 1, "diagnosis": {"facts": {"names": ["a", "b"]}, "oom": False}}],
         "odd": {"__migrator_type__": "dict"}, "tuple": (1, "a"), "set": {1, 2}, "bytes": b"\x00\xff",
         "int_keys": {1: "one"}, "unicode": "模型 \u2028 \x00"}


def test_serializer_round_trips_the_state_types():
    serde = StateSerializer()
    type_, blob = serde.dumps_typed(STATE)
    assert type_ == FORMAT and json.loads(blob)
    assert serde.loads_typed((type_, blob)) == STATE


def test_serializer_refuses_to_write_an_object_it_cannot_read_back():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="allow-list"):
        StateSerializer().dumps_typed({"x": Opaque()})


@pytest.mark.parametrize("entry", [
    ("msgpack", b"\x81\xa1a\x01"),
    ("pickle", b"cos\nsystem\n(S'touch x'\ntR."),
    ("json", b'{"lc": 2, "type": "constructor", "id": ["os", "system"]}'),
    ("null", b""),
    (FORMAT, b"not json"),
    (FORMAT, b'{"__migrator_type__": "object", "module": "os", "name": "system"}'),
    (FORMAT, b'{"__migrator_type__": "set", "items": [[1]]}'),
    (FORMAT, b'{"__migrator_type__": "dict", "items": [[1]]}'),
    (FORMAT, b'{"__migrator_type__": "bytes", "b64": "!!"}'),
    (FORMAT, b"[" * 100000 + b"]" * 100000),
    (FORMAT, b"\xff\xfe"),
], ids=lambda e: e[0] if isinstance(e, tuple) else None)
def test_serializer_refuses_anything_but_its_own_json(entry):
    with pytest.raises(UnsafeStoreError):
        StateSerializer().loads_typed(entry)


# A state as the previous release stored it: its run records have no `yaml`, memory's per-rank keys are ints.
PREVIOUS_RELEASE_STATE = {
    "target": "/r", "output_dir": "models", "device": "auto", "max_rounds": 5, "timeout_s": 1800,
    "env": {"device": "cpu", "npu_model": None, "num_cards": None, "cpu_count": 2, "torch_pair_ok": None},
    "scenario": "B", "recipe_dir": "/r", "vendored": {"model_class": "M", "files": {"modeling": "models/m.py"},
                                                      "codemods": {"m.py": ["AbsoluteImportsCommand"]}},
    "runs": [{"label": "classify", "ok": False, "returncode": 1, "timed_out": False, "seconds": 2.5,
              "res_path": "/r/.migrator/runs/run_0_classify", "log_dir": None, "problem": "traceback in the output",
              "output_file": "/r/.migrator/runs/run_0_classify/output.txt", "summary": "ValueError: x"}],
    "rounds": [{"round": 1, "diagnosis": {"signature": "ValueError: x", "error": "ValueError: x", "location": None,
                                          "oom": False, "rule": None, "diagnosis": "unknown failure: ValueError: x",
                                          "exception": "ValueError", "message": "x", "last_lines": [],
                                          "closest_rule": None},
                "applied": False, "diff": "", "note": "no repair rule matched"}],
    "memory": {"weights_bytes": 10, "per_rank": {1: {"weights_bytes": 10, "kv_cache_bytes": 1, "needed_bytes": 20,
                                                     "fits": True}}, "cards_needed": 1},
}


@pytest.mark.parametrize("field, value, ok", [
    (None, None, True),
    ("runs", [{"ok": "yes"}], False),
    ("rounds", [{"round": 1, "diagnosis": "not a mapping"}], False),
    ("memory", {"per_rank": {"one": {}}}, False),
    ("env", {"cpu_count": "two"}, False),
    ("runs", [{"label": "classify", "ok": True, "yaml": None, "a_key_a_later_node_adds": 1}], True),
])
def test_a_resumed_store_is_checked_against_the_record_types(tmp_path, field, value, ok):
    from agent.errors import InputError
    from agent.workflow.run import _check_resumed_state

    state = dict(PREVIOUS_RELEASE_STATE, **({field: value} if field else {}))
    state = StateSerializer().loads_typed(StateSerializer().dumps_typed(state))   # as the store gives it back
    if ok:
        _check_resumed_state(state, tmp_path / "c.sqlite")
    else:
        with pytest.raises(InputError, match=f"state field '{field}'"):
            _check_resumed_state(state, tmp_path / "c.sqlite")


def test_stored_exception_is_data_not_the_class():
    from agent.workflow.checkpoint_serde import StoredError

    serde = StateSerializer()
    loaded = serde.loads_typed(serde.dumps_typed(KeyError("x")))
    assert type(loaded) is StoredError and "KeyError" in str(loaded)


def test_interrupted_graph_resumes_with_this_serializer(tmp_path):
    """A real langgraph graph on the real SqliteSaver: the first invocation dies in node b (its
    error is stored), a new saver on the same file resumes at b and finishes. `steps` has a list
    reducer, as MigrationState's runs and rounds do: nodes return only their new items."""
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    class S(TypedDict, total=False):
        steps: Annotated[list, operator.add]
        info: dict

    calls = {"b": 0}

    def a(state):
        return {"steps": ["a"], "info": {"t": (1, 2), "n": None}}

    def b(state):
        calls["b"] += 1
        if calls["b"] == 1:
            raise RuntimeError("killed")
        return {"steps": ["b"]}

    graph = StateGraph(S)
    graph.add_node("a", a)
    graph.add_node("b", b)
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", END)
    db = tmp_path / "c.sqlite"
    config = {"configurable": {"thread_id": "t"}}

    def app():
        return graph.compile(checkpointer=SqliteSaver(sqlite3.connect(str(db), check_same_thread=False),
                                                      serde=StateSerializer()))

    with pytest.raises(RuntimeError):
        app().invoke({"steps": []}, config, durability="sync")
    resumed = app()
    assert resumed.get_state(config).next == ("b",)
    final = resumed.invoke(None, config, durability="sync")
    assert final == {"steps": ["a", "b"], "info": {"t": (1, 2), "n": None}} and calls["b"] == 2
    kinds = {row[0] for row in sqlite3.connect(str(db)).execute("SELECT type FROM checkpoints UNION "
                                                                 "SELECT type FROM writes")}
    assert kinds == {FORMAT}
