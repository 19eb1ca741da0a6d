"""agent/migrate/acquire.py against the real huggingface_hub, offline, on hand-built HF caches.

Each acquisition runs in a subprocess: huggingface_hub reads HF_HOME / HF_HUB_OFFLINE / HF_ENDPOINT into
`huggingface_hub.constants` at import time. The cache uses the standard layout
`$HF_HOME/hub/models--Org--Name/{blobs/<sha>, snapshots/<commit>/<file -> ../../blobs/<sha>>, refs/<branch>}`
(refs file content = the commit hash, no newline), plus optionally `trees/<commit>.json`, the tree listing
huggingface_hub writes after an online `snapshot_download`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.migrate.acquire import SMALL_FILE_PATTERNS, WEIGHTS_LIMIT_BYTES, parse_hub_ref
from agent.errors import EXIT_NEEDS_WEIGHTS
from locations import REPO_ROOT
from hub_cache import MAIN, add_snapshot, run_acquire, small_only

DEV = "b" * 40
OLD = "c" * 40


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    out = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def with_config(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    config = json.loads(files["config.json"])
    config.update(changes)
    return {**files, "config.json": json.dumps(config).encode()}


@pytest.fixture
def hf_home(tmp_path) -> Path:
    return tmp_path / "hf"


@pytest.fixture
def full_cache(hf_home, tiny_files) -> Path:
    """Org/Tiny-Model: main (complete), dev branch and an old commit with different configs."""
    add_snapshot(hf_home, "Org/Tiny-Model", MAIN, with_config(tiny_files, _rev="main"), refs=("main",))
    add_snapshot(hf_home, "Org/Tiny-Model", DEV, with_config(tiny_files, _rev="dev"), refs=("dev",))
    add_snapshot(hf_home, "Org/Tiny-Model", OLD, with_config(tiny_files, _rev="old"))
    return hf_home


# ---- parse_hub_ref --------------------------------------------------------------------------
@pytest.mark.parametrize("text, repo_id, revision, url", [
    ("https://huggingface.co/Org/Name", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("https://huggingface.co/Org/Name/", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("http://huggingface.co/Org/Name?library=transformers", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("huggingface.co/Org/Name", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("https://hf.co/Org/Name", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("https://huggingface.co/Org/Name/tree/dev", "Org/Name", "dev", "https://huggingface.co/Org/Name/tree/dev"),
    ("https://huggingface.co/Org/Name/tree/" + OLD, "Org/Name", OLD, "https://huggingface.co/Org/Name/tree/" + OLD),
    ("https://huggingface.co/Org/Name/blob/main/config.json", "Org/Name", "main",
     "https://huggingface.co/Org/Name/tree/main"),
    ("https://huggingface.co/Org/Name/resolve/v1.0/model.safetensors", "Org/Name", "v1.0",
     "https://huggingface.co/Org/Name/tree/v1.0"),
    ("https://huggingface.co/Org/Name/tree/refs%2Fpr%2F3", "Org/Name", "refs/pr/3",
     "https://huggingface.co/Org/Name/tree/refs%2Fpr%2F3"),
    ("https://huggingface.co/models/Org/Name", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("hf://Org/Name@dev", "Org/Name", "dev", "https://huggingface.co/Org/Name/tree/dev"),
    ("Org/Name", "Org/Name", None, "https://huggingface.co/Org/Name"),
    ("my.org/Name-1.5B_x", "my.org/Name-1.5B_x", None, "https://huggingface.co/my.org/Name-1.5B_x"),
])
def test_parse_hub_ref_accepts(text, repo_id, revision, url):
    ref = parse_hub_ref(text)
    assert ref is not None and (ref.repo_id, ref.revision, ref.url) == (repo_id, revision, url)


@pytest.mark.parametrize("text", [
    "ftp://x", "a/b/c", "name", "", "./org/name", "/abs/path", "~/x/y", "https://example.com/Org/Name",
    "https://huggingface.co/datasets/Org/Name", "https://huggingface.co/spaces/Org/Name",
    "https://huggingface.co/Org", "https://huggingface.co/Org/Name/discussions/3", "a--b/c", "org/na me",
])
def test_parse_hub_ref_rejects(text):
    assert parse_hub_ref(text) is None


def test_small_file_patterns_exclude_weights(tiny_files):
    """The first snapshot_download fetches config, tokenizer, generation config, *.py — never weights."""
    from huggingface_hub.utils import filter_repo_objects

    repo = [*tiny_files, "modeling_x.py", "model-00001-of-00002.safetensors", "pytorch_model.bin",
            "model.safetensors.index.json", "tokenizer.model", "merges.txt", "vocab.json", "original/consolidated.pth"]
    picked = set(filter_repo_objects(repo, allow_patterns=SMALL_FILE_PATTERNS))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "modeling_x.py",
            "model.safetensors.index.json", "tokenizer.model", "merges.txt", "vocab.json"} <= picked
    assert not {p for p in picked if p.endswith((".safetensors", ".bin", ".pth"))}


# ---- resolution from the cache ----------------------------------------------------------
def test_link_resolves_to_cached_snapshot(full_cache):
    out = run_acquire("https://huggingface.co/Org/Tiny-Model", full_cache)
    assert out["ok"], out
    assert out["model_dir"].endswith(f"models--Org--Tiny-Model/snapshots/{MAIN}")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(out["files"])
    assert out["config"]["_rev"] == "main"
    assert out["source"] == "https://huggingface.co/Org/Tiny-Model"
    assert out["name"] == "Tiny-Model"
    assert out["offline"] is True and out["cache"] == str(full_cache / "hub")
    # Small files first; the weights are already cached, so no second (weights) call.
    assert len(out["calls"]) == 1 and out["calls"][0]["allow_patterns"] == SMALL_FILE_PATTERNS


def test_repo_id(full_cache):
    out = run_acquire("Org/Tiny-Model", full_cache)
    assert out["ok"], out
    assert out["model_dir"].endswith(MAIN) and out["config"]["_rev"] == "main"
    assert out["source"] == "https://huggingface.co/Org/Tiny-Model"


@pytest.mark.parametrize("suffix, rev", [("/tree/dev", "dev"), (f"/tree/{OLD}", "old"), (f"/tree/{DEV}", "dev"),
                                         ("/blob/main/config.json", "main"), ("/blob/dev/tokenizer.json", "dev")])
def test_revisions_pick_the_right_snapshot(full_cache, suffix, rev):
    link = "https://huggingface.co/Org/Tiny-Model" + suffix
    out = run_acquire(link, full_cache)
    assert out["ok"], out
    assert out["config"]["_rev"] == rev
    assert "model.safetensors" in out["files"]
    revision = suffix.split("/")[2]
    assert out["source"] == f"https://huggingface.co/Org/Tiny-Model/tree/{revision}"


def test_unknown_revision_offline(full_cache):
    out = run_acquire("https://huggingface.co/Org/Tiny-Model/tree/nope", full_cache)
    assert not out["ok"] and out["kind"] == "InputError" and out["exit_code"] == 2
    assert "Org/Tiny-Model@nope" in out["error"] and "HF_ENDPOINT" in out["error"]


# ---- weights: size from metadata, refusal, partial caches ----------------------------------
def test_large_weights_refused_from_index_metadata(hf_home, tiny_files):
    small = small_only(tiny_files)
    index = {"metadata": {"total_size": 6_000_000_000},
             "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    add_snapshot(hf_home, "Org/Big", MAIN, {**small, "model.safetensors.index.json": json.dumps(index).encode()},
                 refs=("main",))
    out = run_acquire("https://huggingface.co/Org/Big", hf_home)
    assert not out["ok"] and out["exit_code"] == 5, out
    assert "--weights" in out["error"] and "6.0 GB" in out["error"]
    # Only the small-files call happened: nothing tried to fetch the shards.
    assert [c["allow_patterns"] for c in out["calls"]] == [SMALL_FILE_PATTERNS]


def test_a_quantized_checkpoint_is_refused_before_its_weights_are_asked_for(hf_home, tiny_files):
    """A quantization the migrator neither serves nor converts (block-FP8 e5m2 here; e4m3 is converted): refused
    by its config (exit 3) before the weights are fetched or asked for (exit 5), the line saying how to download
    it and convert it with upstream's converter, which reads it. DeepSeek-V3's own form (e4m3, 690 GB, no
    unquantized original) is converted at migration: asked for as any large checkpoint is (exit 5, --weights)."""
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    index = {"metadata": {"total_size": 689_000_000_000}, "weight_map": {"lm_head.weight": "model-00001-of-00163.safetensors"}}
    for repo, quant, code in (("Org/E5m2", dict(fp8, fmt="e5m2"), 3), ("Org/Fp8", fp8, 5)):
        small = with_config(small_only(tiny_files), num_nextn_predict_layers=1, quantization_config=quant)
        add_snapshot(hf_home, repo, MAIN, {**small, "model.safetensors.index.json": json.dumps(index).encode()},
                     refs=("main",))
        out = run_acquire(repo, hf_home)
        assert not out["ok"] and out["exit_code"] == code, out
        assert [c["allow_patterns"] for c in out["calls"]] == [SMALL_FILE_PATTERNS]
        if code == 5:
            assert "--weights" in out["error"] and "689.0 GB" in out["error"]
            continue
        assert "weights are quantized: block-FP8 (quant_method fp8, fmt e5m2, weight_block_size 128x128)" in out["error"]
        assert f"download it (`hf download {repo} --local-dir DIR`), then convert it to bf16" in out["error"]
        assert "`python3 models/deepseek_r1/utils/convert_model.py --input_fp8_hf_path DIR --output_hf_path DIR-bf16`, " \
               "then migrate DIR-bf16" in out["error"]


def test_large_weights_refused_from_cached_tree_listing(hf_home, tiny_files):
    """The tree listing huggingface_hub caches per commit has exact sizes: trusted over everything else."""
    small = small_only(tiny_files)
    add_snapshot(hf_home, "Org/Big", MAIN, small, refs=("main",),
                 tree={**{name: len(data) for name, data in small.items()}, "model.safetensors": 7_500_000_000,
                       "pytorch_model.bin": 7_500_000_000})
    out = run_acquire("Org/Big", hf_home)
    assert not out["ok"] and out["exit_code"] == 5, out
    assert "7.5 GB" in out["error"] and "--weights" in out["error"]   # safetensors only, not + .bin
    assert len(out["calls"]) == 1


def test_cached_weights_are_used_even_when_the_index_says_large(hf_home, tiny_files):
    """The limit is about downloading: shards already in the cache cost nothing."""
    index = {"metadata": {"total_size": 6_000_000_000}, "weight_map": {"x": "model.safetensors"}}
    add_snapshot(hf_home, "Org/Cached", MAIN,
                 {**tiny_files, "model.safetensors.index.json": json.dumps(index).encode()}, refs=("main",))
    out = run_acquire("Org/Cached", hf_home)
    assert out["ok"], out
    assert len(out["calls"]) == 1


def test_partial_cache_small_index_weights_missing(hf_home, tiny_files):
    """Small files cached, shards not, offline: a one-line error saying the weights are missing."""
    index = {"metadata": {"total_size": 1_000_000}, "weight_map": {"x": "model.safetensors"}}
    add_snapshot(hf_home, "Org/Partial", MAIN,
                 {**small_only(tiny_files), "model.safetensors.index.json": json.dumps(index).encode()},
                 refs=("main",))
    out = run_acquire("Org/Partial", hf_home)
    assert not out["ok"] and out["kind"] == "InputError", out
    assert "weights are missing from the local Hugging Face cache" in out["error"]
    assert "model.safetensors" in out["error"] and "HF_HUB_OFFLINE" in out["error"]
    # Second call asked for the weights by name, pinned to the resolved commit.
    assert out["calls"][0]["allow_patterns"] == SMALL_FILE_PATTERNS
    assert out["calls"][1]["revision"] == MAIN and "model.safetensors" in out["calls"][1]["allow_patterns"]


def test_partial_cache_with_tree_listing(hf_home, tiny_files):
    """With the tree listing cached, huggingface_hub itself reports the incomplete snapshot."""
    small = small_only(tiny_files)
    add_snapshot(hf_home, "Org/Partial", MAIN, small, refs=("main",),
                 tree={**{name: len(data) for name, data in small.items()},
                       "model.safetensors": len(tiny_files["model.safetensors"])})
    out = run_acquire("Org/Partial", hf_home)
    assert not out["ok"] and out["kind"] == "InputError", out
    assert "weights are missing from the local Hugging Face cache" in out["error"]
    assert len(out["calls"]) == 2


def test_partial_cache_without_any_weight_metadata(hf_home, tiny_files):
    add_snapshot(hf_home, "Org/Partial", MAIN, small_only(tiny_files), refs=("main",))
    out = run_acquire("Org/Partial", hf_home)
    assert not out["ok"] and out["kind"] == "InputError", out
    assert "weights are missing from the local Hugging Face cache" in out["error"]
    assert len(out["calls"]) == 1


def test_weights_dir_with_config_is_used_directly(hf_home, tiny_files, tmp_path):
    """--weights with a complete checkpoint: used as is, no hub access at all (repo not even cached)."""
    local = tmp_path / "local"
    local.mkdir()
    for name, data in tiny_files.items():
        (local / name).write_bytes(data)
    out = run_acquire("https://huggingface.co/Org/Huge/tree/v2", hf_home, weights=str(local))
    assert out["ok"], out
    assert out["model_dir"] == str(local.resolve())
    assert out["source"] == "https://huggingface.co/Org/Huge/tree/v2" and out["name"] == "Huge"
    assert out["calls"] == []


def test_weights_dir_merged_with_cached_small_files(hf_home, tiny_files, tmp_path):
    """--weights with only the weight files: merged with config/tokenizer from the hub cache."""
    add_snapshot(hf_home, "Org/Big", MAIN, small_only(tiny_files), refs=("main",))
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "model.safetensors").write_bytes(tiny_files["model.safetensors"])
    out = run_acquire("Org/Big", hf_home, weights=str(shards))
    assert out["ok"], out
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(out["files"])
    assert Path(out["model_dir"], "model.safetensors").resolve() == (shards / "model.safetensors").resolve()
    assert out["model_dir"].startswith(str(hf_home.parent / "xdg" / "infer-migrator"))


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_weights_dir(hf_home, tmp_path, make):
    path = tmp_path / "w"
    if make == "empty":
        path.mkdir()
    out = run_acquire("Org/Big", hf_home, weights=str(path))
    assert not out["ok"] and out["kind"] == "InputError" and "--weights" in out["error"]


# ---- errors ------------------------------------------------------------------------------
def test_repo_not_in_cache_offline(hf_home):
    out = run_acquire("https://huggingface.co/Org/Absent", hf_home)
    assert not out["ok"] and out["kind"] == "InputError" and out["exit_code"] == 2, out
    assert "not in the local Hugging Face cache" in out["error"]
    assert "HF_ENDPOINT" in out["error"] and "HF_HUB_OFFLINE" in out["error"]
    assert str(hf_home / "hub") in out["error"]


@pytest.mark.parametrize("target", ["ftp://x", "a/b/c", "https://example.com/Org/Name",
                                    "https://huggingface.co/datasets/Org/Name", "Org--x/Name"])
def test_garbage_is_input_error(hf_home, target):
    out = run_acquire(target, hf_home)
    assert not out["ok"] and out["kind"] == "InputError" and out["exit_code"] == 2, out
    assert out["calls"] == []


def test_local_dir_without_config(hf_home, tmp_path):
    (tmp_path / "model").mkdir()
    out = run_acquire(str(tmp_path / "model"), hf_home)
    assert not out["ok"] and out["kind"] == "InputError" and "config.json" in out["error"]


def test_local_dir_with_config(hf_home, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    out = run_acquire(str(tmp_path / "model"), hf_home)
    assert out["ok"] and out["model_dir"] == str((tmp_path / "model").resolve()) and out["name"] == "model"


# ---- HF_ENDPOINT -------------------------------------------------------------------------
def test_hf_endpoint_mirror_offline(full_cache):
    """With a mirror configured, offline mode still serves the cache and the mirror is what the hub
    library would use (never contacted here); links on the mirror host are understood too."""
    mirror = "https://hf-mirror.example.com"
    out = run_acquire("Org/Tiny-Model", full_cache, endpoint=mirror + "/")
    assert out["ok"], out
    assert out["endpoint"] == mirror and out["offline"] is True
    out = run_acquire(f"{mirror}/Org/Tiny-Model/tree/dev", full_cache, endpoint=mirror)
    assert out["ok"], out
    assert out["config"]["_rev"] == "dev"
    assert out["source"] == "https://huggingface.co/Org/Tiny-Model/tree/dev"
    out = run_acquire("Org/Absent", full_cache, endpoint=mirror)
    assert not out["ok"] and "HF_ENDPOINT" in out["error"]


@pytest.mark.slow  # the offline hub-link migration covers the cache path by default
def test_hf_endpoint_unreachable_falls_back_to_cache(full_cache):
    """Not offline, HF_ENDPOINT on a closed local port: the library's real request fails at once and
    the cached snapshot is served; a repo not cached names the endpoint that could not be reached."""
    endpoint = "http://127.0.0.1:9"
    out = run_acquire("Org/Tiny-Model", full_cache, offline=False, endpoint=endpoint)
    assert out["ok"], out
    assert out["endpoint"] == endpoint and out["offline"] is False and out["config"]["_rev"] == "main"
    out = run_acquire("Org/Absent", full_cache, offline=False, endpoint=endpoint)
    assert not out["ok"] and out["kind"] == "InputError", out
    assert endpoint in out["error"] and "cannot be reached" in out["error"]


def test_weights_limit_is_5gb():
    assert WEIGHTS_LIMIT_BYTES == 5 * 10**9


# ---- end to end: an HF link served from the local cache, offline -----------------------------
def test_hub_link_migrates_end_to_end_offline(full_cache, tmp_path):
    env = {**os.environ, "HF_HOME": str(full_cache), "HF_HUB_OFFLINE": "1",
           "XDG_CACHE_HOME": str(full_cache.parent / "xdg")}
    link = "https://huggingface.co/Org/Tiny-Model/tree/dev"
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", link, "--output-dir", str(tmp_path / "out"),
                           "--device", "cpu", "--max-new-tokens", "8", "--json"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["model_name"] == "tiny_model" and summary["status"] == "ok"    # from the repo name
    recipe = tmp_path / "out" / "tiny_model"
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    assert baseline["model_config"]["model_source"] == link                         # the link, revision kept
    settings = (recipe / "config" / "tiny_model_1card_eager.yaml").read_text()
    assert f"snapshots/{DEV}" in settings                                           # the dev snapshot was used
    assert baseline["verification"]["parity"]["ok"]


# ---- online, against a local server speaking the Hub API (tests/support/hf_fixture.py) ----------------------
@pytest.fixture
def hub_server(tiny_files):
    from hf_fixture import HubServer

    server = HubServer({"Org/Tiny-Model": tiny_files, "Org/Big": tiny_files},
                       listed_sizes={"Org/Big/model.safetensors": 7 * 10**9})
    yield server
    server.close()


def test_online_sizes_from_a_dry_run_then_the_weights(hf_home, hub_server):
    out = run_acquire("Org/Tiny-Model", hf_home, offline=False, endpoint=hub_server.url)
    assert out["ok"], out
    assert "model.safetensors" in out["files"]
    weights = [i for i, (m, p) in enumerate(hub_server.requests) if p.endswith("/model.safetensors")]
    methods = [hub_server.requests[i][0] for i in weights]
    assert methods[0] == "HEAD" and methods.count("GET") == 1 and methods[-1] == "GET"  # sized, then fetched once


def test_online_dry_run_too_large_fetches_no_weights(hf_home, hub_server):
    out = run_acquire("Org/Big", hf_home, offline=False, endpoint=hub_server.url)
    assert not out["ok"] and out["exit_code"] == EXIT_NEEDS_WEIGHTS and "7.0 GB" in out["error"]
    weights = [m for m, p in hub_server.requests if p.endswith("/model.safetensors")]
    assert weights == ["HEAD"]          # the dry run asked for its size; nothing fetched it
    assert (hf_home / "hub" / "models--Org--Big" / "snapshots" / hub_server.commit / "config.json").is_file()
