"""ModelScope as a model source (agent.migrate.hub_modelscope) against the real `modelscope` library and its cache.

The cache is filled by modelscope's own `snapshot_download`, from a local server that speaks the two hub
endpoints it uses (tests/support/modelscope_fixture.py); then the tests go offline (HF_HUB_OFFLINE=1) or point
MODELSCOPE_ENDPOINT at that server and run acquire() / `migrator run` in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.migrate import hub_modelscope
from agent.migrate.acquire import hub_target, parse_hub_ref
from agent.errors import InputError
from modelscope_fixture import ModelScopeServer, fill_cache, modelscope_env
from locations import REPO_ROOT

REPO = "Org/Tiny-Model"

SCRIPT = r"""
import json, sys
from agent.migrate.acquire import acquire
from agent.errors import MigratorError
try:
    got = acquire(sys.argv[1], weights=sys.argv[2] or None)
    cfg = json.loads((got.model_dir / "config.json").read_text())
    out = {"ok": True, "model_dir": str(got.model_dir), "source": got.source, "name": got.name_hint,
           "files": sorted(p.name for p in got.model_dir.iterdir()), "rev": cfg.get("_rev")}
except MigratorError as exc:
    out = {"ok": False, "error": str(exc), "exit_code": exc.exit_code}
print(json.dumps(out))
"""


def run_acquire(target: str, cache: Path, *, offline: bool = True, endpoint: str | None = None,
                weights: str | None = None) -> dict:
    env = modelscope_env(cache, endpoint)
    env["MODELSCOPE_REPO_TREE_PAGE_MAX_ATTEMPTS"] = "1"       # an unreachable hub: fail fast
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, target, weights or ""], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        assert "\n" not in out["error"]
    return out


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    out = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def _rev(files: dict[str, bytes], rev: str) -> dict[str, bytes]:
    config = json.loads(files["config.json"])
    return {**files, "config.json": json.dumps(dict(config, _rev=rev)).encode()}


def _sharded(files: dict[str, bytes], total_size: int) -> dict[str, bytes]:
    """The single safetensors file re-published as a one-shard index with a claimed total_size."""
    from safetensors import safe_open

    out = {k: v for k, v in files.items() if k != "model.safetensors"}
    out["model-00001-of-00001.safetensors"] = files["model.safetensors"]
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(files["model.safetensors"])
        f.flush()
        with safe_open(f.name, "pt") as st:
            names = list(st.keys())
    out["model.safetensors.index.json"] = json.dumps({
        "metadata": {"total_size": total_size},
        "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}).encode()
    return out


@pytest.fixture
def server(tiny_files):
    s = ModelScopeServer({REPO: {"master": _rev(tiny_files, "master"), "v1.0": _rev(tiny_files, "v1.0")},
                          "Org/Big": {"master": _sharded(tiny_files, 7 * 10**9)},
                          "Org/Sharded": {"master": _sharded(tiny_files, 10**6)}},
                         listed_sizes={"Org/Big/model-00001-of-00001.safetensors": 7 * 10**9})
    yield s
    s.close()


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "modelscope"


# ---- links and ids --------------------------------------------------------------------------
@pytest.mark.parametrize("text, repo_id, revision", [
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", None),
    ("https://www.modelscope.cn/models/Qwen/Qwen2.5-0.5B/summary", "Qwen/Qwen2.5-0.5B", None),
    ("modelscope.cn/models/Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", None),
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B/files", "Qwen/Qwen2.5-0.5B", None),
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B/tree/v1.0.1", "Qwen/Qwen2.5-0.5B", "v1.0.1"),
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B/file/view/dev/config.json", "Qwen/Qwen2.5-0.5B", "dev"),
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B/resolve/master/model.safetensors", "Qwen/Qwen2.5-0.5B", "master"),
    ("https://modelscope.cn/models/Qwen/Qwen2.5-0.5B/files?revision=v2", "Qwen/Qwen2.5-0.5B", "v2"),
    ("https://www.modelscope.ai/models/Org/Name", "Org/Name", None),
])
def test_modelscope_links_parse(text, repo_id, revision):
    ref = parse_hub_ref(text)
    assert ref is not None and ref.hub == "modelscope"
    assert (ref.repo_id, ref.revision) == (repo_id, revision)
    assert ref.url == hub_modelscope.canonical_url(repo_id, revision)
    assert parse_hub_ref(ref.url) == ref                      # the recorded source reads back the same


@pytest.mark.parametrize("text, why", [
    ("https://modelscope.cn/datasets/Org/Name", "not a model"),
    ("https://modelscope.cn/models/Org", "needs /models/Org/Name"),
    ("https://modelscope.cn/models/Org/Na me", "not a ModelScope model id"),
    ("https://modelscope.cn/models/Org/Name/tree", "without a revision"),
    ("https://modelscope.cn/models/Org/Name/nonsense", "unknown ModelScope model page"),
    ("ftp://modelscope.cn/models/Org/Name", "unsupported scheme"),
])
def test_bad_modelscope_links_say_why(text, why):
    from agent.migrate.acquire import hub_ref_problem

    assert parse_hub_ref(text) is None and why in hub_ref_problem(text)


def test_hub_flag_turns_an_id_into_the_canonical_link(tmp_path, monkeypatch):
    assert hub_target("Org/Name", "modelscope") == "https://modelscope.cn/models/Org/Name"
    assert hub_target("Org/Name", None) == "Org/Name" and hub_target("Org/Name", "hf") == "Org/Name"
    link = "https://modelscope.cn/models/Org/Name/tree/v1"
    assert hub_target(link, "modelscope") == link and hub_target(link, None) == link
    with pytest.raises(InputError, match="--hub hf"):
        hub_target(link, "hf")
    with pytest.raises(InputError, match="not a ModelScope link"):
        hub_target("https://huggingface.co/Org/Name", "modelscope")
    with pytest.raises(InputError, match="not a ModelScope model id"):
        hub_target("Org/Na me", "modelscope")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert hub_target("local", "modelscope") == "local"        # a directory stays a directory


# ---- from the cache modelscope wrote, offline -----------------------------------------------
def test_offline_id_and_link_resolve_to_the_cached_snapshot(server, cache):
    snapshot = fill_cache(server, cache, REPO)
    assert snapshot == cache / "models" / "Org--Tiny-Model" / "snapshots" / "master"    # modelscope's layout
    for target in (hub_target(REPO, "modelscope"), "modelscope.cn/models/Org/Tiny-Model/summary"):
        out = run_acquire(target, cache)
        assert out["ok"], out
        assert Path(out["model_dir"]) == snapshot and out["rev"] == "master"
        assert out["source"] == "https://modelscope.cn/models/Org/Tiny-Model" and out["name"] == "Tiny-Model"
        assert "model.safetensors" in out["files"]


def test_offline_revision_picks_its_snapshot(server, cache):
    fill_cache(server, cache, REPO)
    fill_cache(server, cache, REPO, revision="v1.0")
    out = run_acquire("https://modelscope.cn/models/Org/Tiny-Model/file/view/v1.0/config.json", cache)
    assert out["ok"] and out["rev"] == "v1.0" and out["source"].endswith("/tree/v1.0")
    out = run_acquire("https://modelscope.cn/models/Org/Tiny-Model/tree/v9", cache)
    assert not out["ok"] and out["exit_code"] == 2
    assert "not in the local ModelScope cache" in out["error"] and "v9" in out["error"]


def test_offline_not_cached_is_one_line_exit_2(cache):
    out = run_acquire("https://modelscope.cn/models/Org/Absent", cache)
    assert not out["ok"] and out["exit_code"] == 2
    assert "not in the local ModelScope cache" in out["error"] and "HF_HUB_OFFLINE is set" in out["error"]


def test_offline_partial_cache_small_weights_missing(server, cache):
    fill_cache(server, cache, "Org/Sharded", patterns=["*.json", "tokenizer*"])
    out = run_acquire("https://modelscope.cn/models/Org/Sharded", cache)
    assert not out["ok"] and out["exit_code"] == 2
    assert "weights are missing" in out["error"] and "model-00001-of-00001.safetensors" in out["error"]


def test_offline_partial_cache_index_says_too_large(server, cache):
    fill_cache(server, cache, "Org/Big", patterns=["*.json", "tokenizer*"])
    out = run_acquire("https://modelscope.cn/models/Org/Big", cache)
    assert not out["ok"] and out["exit_code"] == 5
    assert "7.0 GB" in out["error"] and "modelscope download --model Org/Big" in out["error"]


def test_weights_dir_with_a_cached_config(server, cache, tiny_files, tmp_path):
    fill_cache(server, cache, REPO, patterns=["*.json", "tokenizer*"])
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(tiny_files["model.safetensors"])
    out = run_acquire(hub_target(REPO, "modelscope"), cache, weights=str(weights))
    assert out["ok"] and {"config.json", "model.safetensors"} <= set(out["files"])
    assert Path(out["model_dir"], "model.safetensors").resolve() == (weights / "model.safetensors").resolve()


# ---- online: MODELSCOPE_ENDPOINT (a mirror) ---------------------------------------------------
def test_online_mirror_downloads_small_files_then_weights(server, cache):
    out = run_acquire(hub_target(REPO, "modelscope"), cache, offline=False, endpoint=server.url)
    assert out["ok"] and "model.safetensors" in out["files"]
    fetched = [r for r in server.requests if "FilePath=" in r]
    assert any("FilePath=config.json" in r for r in fetched) and fetched[-1].endswith("FilePath=model.safetensors")


def test_online_listing_too_large_downloads_no_weights(server, cache):
    out = run_acquire("https://modelscope.cn/models/Org/Big", cache, offline=False, endpoint=server.url)
    assert not out["ok"] and out["exit_code"] == 5
    assert "7.0 GB" in out["error"]
    fetched = [r for r in server.requests if "FilePath=" in r]
    assert fetched and not any(r.endswith(".safetensors") for r in fetched)


def test_online_unknown_repo_names_the_mirror(server, cache):
    out = run_acquire("https://modelscope.cn/models/Org/Absent", cache, offline=False, endpoint=server.url)
    assert not out["ok"] and out["exit_code"] == 2 and server.url in out["error"] and "not found" in out["error"]


def test_unreachable_mirror_falls_back_to_the_cache(server, cache):
    fill_cache(server, cache, REPO)
    out = run_acquire(hub_target(REPO, "modelscope"), cache, offline=False, endpoint="http://127.0.0.1:9")
    assert out["ok"] and out["rev"] == "master"
    out = run_acquire("https://modelscope.cn/models/Org/Absent", cache, offline=False, endpoint="http://127.0.0.1:9")
    assert not out["ok"] and "http://127.0.0.1:9" in out["error"] and "cannot be reached" in out["error"]


# ---- end to end ------------------------------------------------------------------------------
def test_modelscope_id_and_link_migrate_end_to_end_offline(server, cache, tmp_path):
    """`migrator run --hub modelscope Org/Name` and `migrator run modelscope.cn/models/Org/Name`, offline,
    from the cache modelscope wrote; the second stops at the "exists" check, having resolved the same
    snapshot (the whole pipeline is run once)."""
    snapshot = fill_cache(server, cache, REPO)
    env = dict(modelscope_env(cache), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--hub", "modelscope", REPO, "--output-dir",
                           str(out), "--device", "cpu", "--max-new-tokens", "8", "--json"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "ok" and summary["model_name"] == "tiny_model"
    recipe = out / "tiny_model"
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    assert baseline["model_config"]["model_source"] == "https://modelscope.cn/models/Org/Tiny-Model"
    assert baseline["verification"]["parity"]["ok"]
    assert str(snapshot) in (recipe / "config" / "tiny_model_1card_eager.yaml").read_text()
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", "modelscope.cn/models/Org/Tiny-Model",
                           "--output-dir", str(out), "--device", "cpu"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "tiny_model already exists" in errors[0]
    assert "Traceback" not in proc.stderr
