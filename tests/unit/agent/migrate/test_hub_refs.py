"""Hub references (agent.migrate.hub_refs, SPEC §6): revision, repo id and file names are checked after
URL-decoding (repeatedly) before any cache lookup or download, on both hubs, and every path a hub library
returns must lie inside its cache. Variants here are built from pieces (encodings, depths, separators) the
code never lists one by one; a small hypothesis pass mixes them further (bounded in time)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.errors import EXIT_USAGE, InputError
from agent.migrate import hub_refs
from agent.migrate.acquire import HubRef, hub_ref_problem, parse_hub_ref
from hub_cache import MAIN, add_snapshot, run_acquire, small_only
from fuzz_strategies import PIECES


def encode(text: str, rounds: int, upper: bool = True) -> str:
    """`text` URL-encoded `rounds` times (each round also encodes the previous round's '%')."""
    for _ in range(rounds):
        text = quote(text, safe="")
        if not upper:
            text = text.lower()
    return text


BAD_REVISIONS = {
    "dotdot_up": "../../../outside",
    "dotdot_inside": "main/../../x",
    "dotdot_only": "..",
    "absolute": "/etc",
    "absolute_deep": "/home/user/models/secret",
    "backslash": "..\\..\\x",
    "windows_drive": "C:/Users",
    "home": "~/models",
    "nul": "ma\x00in",
    "newline": "main\nx",
    "tab": "ma\tin",
    "del": "ma\x7fin",
    "rtl_override": "main\u202e",
    "space": "my branch",
    "colon": "a:b",
    "lock": "feature.lock",
    "leading_dot": ".hidden",
    "component_dot": "a/.b",
    "trailing_slash": "dev/",
    "double_slash": "a//b",
    "at_brace": "main@{1}",
    "caret": "main^",
    "star": "ma*",
    "dash": "-rf",
    "trailing_dot": "v1.",
    "empty": "",
}


@pytest.mark.parametrize("rounds", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(BAD_REVISIONS))
@pytest.mark.parametrize("form", ["hf_tree", "hf_uri", "ms_tree", "ms_query"])
def test_bad_revision_is_refused_at_any_encoding_depth(form, name, rounds):
    raw = BAD_REVISIONS[name]
    if form == "hf_uri" and rounds == 0 and "/" in raw:
        rounds = 1     # hf://Org/Name@REV takes a revision without '/'; encoded it is one token
    rev = encode(raw, rounds, upper=rounds % 2 == 0)
    text = {"hf_tree": f"https://huggingface.co/Org/Name/tree/{rev}",
            "hf_uri": f"hf://Org/Name@{rev}",
            "ms_tree": f"https://modelscope.cn/models/Org/Name/tree/{rev}",
            "ms_query": f"https://modelscope.cn/models/Org/Name?revision={rev}"}[form]
    if not rev and form != "ms_query":
        pytest.skip("an empty path segment is no revision at all")
    try:
        ref = parse_hub_ref(text)
    except InputError as exc:
        assert exc.exit_code == EXIT_USAGE and "\n" not in str(exc)
        assert "revision" in str(exc) or "URL-encoded" in str(exc)
        assert hub_ref_problem(text)
        return
    # the only other answer: no revision taken from it at all (a link the hub's parser drops)
    assert ref is None or ref.revision in (None, "main") or hub_refs.revision_problem(ref.revision) is None, ref
    if ref is not None and ref.revision:
        assert not _escapes(ref.revision)


@pytest.mark.parametrize("text, revision", [
    ("https://huggingface.co/Org/Name/tree/refs%2Fpr%2F3", "refs/pr/3"),
    ("https://huggingface.co/Org/Name/tree/refs%252Fpr%252F3", "refs/pr/3"),
    ("https://huggingface.co/Org/Name/tree/feature%2Fnew-attn", "feature/new-attn"),
    ("https://huggingface.co/Org/Name/tree/v1.0", "v1.0"),
    ("https://huggingface.co/Org/Name/tree/" + "e" * 40, "e" * 40),
    ("https://modelscope.cn/models/Org/Name/tree/v1.0.2", "v1.0.2"),
    ("https://modelscope.cn/models/Org/Name?revision=release%2F2024", "release/2024"),
    ("https://modelscope.cn/models/Org/Name/tree/release%252F2024", "release/2024"),
    ("hf://Org/Name@dev", "dev"),
])
def test_branch_tag_and_commit_names_still_work(text, revision):
    ref = parse_hub_ref(text)
    assert ref is not None and ref.revision == revision


@pytest.mark.parametrize("repo_id", ["../x", "Org/..", "..%2F..", "Org/%2E%2E", "Org/Na%00me", "/abs/x",
                                     "Org\\Name", "Org/.hidden", "Org/-x", "a/b/c"])
def test_bad_repo_ids_never_become_a_reference(repo_id):
    with pytest.raises(InputError):
        HubRef(repo_id, None, "x")
    for text in (f"https://modelscope.cn/models/{repo_id}", f"https://huggingface.co/{repo_id}", repo_id):
        try:
            ref = parse_hub_ref(text)
        except InputError:
            continue
        assert ref is None or (".." not in ref.repo_id and not ref.repo_id.startswith("/")), (text, ref)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "a/../../b.safetensors", "..%2Fx.safetensors",
                                  "..%252Fx.safetensors", "a\\b.safetensors", "*.safetensors", "x\x00.bin",
                                  "./model.safetensors", "a//b.bin", "", 5])
def test_bad_file_names_of_an_index_are_refused(name):
    with pytest.raises(hub_refs.BadHubReference) as info:
        hub_refs.checked_filenames([name], "model.safetensors.index.json: weight_map")
    assert "weight_map" in str(info.value)


def test_file_names_of_a_real_index_pass():
    names = ["model-00001-of-00002.safetensors", "sub/dir/model-00002-of-00002.safetensors", "pytorch_model.bin"]
    assert hub_refs.checked_filenames(names, "idx") == names


def test_decoding_stops_on_endless_encodings():
    deep = encode("../x", 12)
    with pytest.raises(hub_refs.BadHubReference, match="still URL-encoded"):
        hub_refs.decoded(deep)


def _escapes(revision: str, root: Path = Path("/cache/hub/models--Org--Name/snapshots")) -> bool:
    resolved = Path(os.path.normpath(root / revision))
    return resolved != root and root not in resolved.parents or resolved == root


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PIECES, min_size=1, max_size=8), st.sampled_from(["hf_tree", "ms_tree", "ms_query", "hf_uri"]))
def test_fuzz_no_accepted_revision_leaves_the_snapshots_folder(pieces, form):
    rev = "".join(pieces)
    text = {"hf_tree": f"https://huggingface.co/Org/Name/tree/{rev}",
            "hf_uri": f"hf://Org/Name@{rev}",
            "ms_tree": f"https://modelscope.cn/models/Org/Name/tree/{rev}",
            "ms_query": f"https://modelscope.cn/models/Org/Name?revision={rev}"}[form]
    try:
        ref = parse_hub_ref(text)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    if ref is None or ref.revision is None:
        return
    got = ref.revision
    assert hub_refs.decoded(got) == got                     # what the hub library sees is decoded once for all
    assert not _escapes(got), (text, got)
    assert "\\" not in got and not any(ord(c) < 32 or ord(c) == 127 for c in got)
    assert ".." not in got.split("/")


@settings(max_examples=200, deadline=None)
@given(st.lists(PIECES, min_size=1, max_size=6))
def test_fuzz_accepted_file_names_stay_inside(pieces):
    name = "".join(pieces) + ".safetensors"
    try:
        names = hub_refs.checked_filenames([name], "idx")
    except hub_refs.BadHubReference:
        return
    root = Path("/cache/snap")
    assert root in Path(os.path.normpath(root / names[0])).parents


# ---- end to end, offline, the real huggingface_hub on a real cache layout ---------------------------
@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    out = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def _outside_checkpoint(tmp_path: Path, tiny_files) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    for name, data in tiny_files.items():
        (outside / name).write_bytes(data)
    return outside


def test_encoded_dotdot_revision_is_not_followed_out_of_the_cache(tmp_path, tiny_files):
    """The reported case: `..%2F` segments that lead from snapshots/ to a folder elsewhere (exit 0 before)."""
    hf_home = tmp_path / "hf"
    add_snapshot(hf_home, "Org/Tiny-Model", MAIN, tiny_files, refs=("main",))
    outside = _outside_checkpoint(tmp_path, tiny_files)
    snapshots = hf_home / "hub" / "models--Org--Tiny-Model" / "snapshots"
    rel = os.path.relpath(outside, snapshots)
    for rounds in (1, 2):
        out = run_acquire(f"https://huggingface.co/Org/Tiny-Model/tree/{encode(rel, rounds)}", hf_home)
        assert not out["ok"] and out["exit_code"] == EXIT_USAGE and "'..'" in out["error"], out
        assert out["calls"] == []                           # refused before any cache lookup


def test_a_snapshot_outside_the_cache_is_refused(tmp_path, tiny_files):
    """Whatever the reference, the folder the hub library returns is resolved and must be in its cache."""
    hf_home = tmp_path / "hf"
    snapshot = add_snapshot(hf_home, "Org/Tiny-Model", MAIN, {}, refs=("main",))
    snapshot.rmdir()
    snapshot.symlink_to(_outside_checkpoint(tmp_path, tiny_files), target_is_directory=True)
    out = run_acquire("Org/Tiny-Model", hf_home)
    assert not out["ok"] and out["exit_code"] == EXIT_USAGE and "outside its cache" in out["error"], out


def test_a_snapshot_file_linking_out_of_the_cache_is_refused(tmp_path, tiny_files):
    hf_home = tmp_path / "hf"
    snapshot = add_snapshot(hf_home, "Org/Tiny-Model", MAIN, small_only(tiny_files), refs=("main",))
    outside = _outside_checkpoint(tmp_path, tiny_files)
    (snapshot / "model.safetensors").symlink_to(outside / "model.safetensors")
    out = run_acquire("Org/Tiny-Model", hf_home)
    assert not out["ok"] and out["exit_code"] == EXIT_USAGE and "outside" in out["error"], out


@pytest.mark.parametrize("shard", ["../../../../outside/model.safetensors", "/etc/passwd", "..%2F..%2Fx.safetensors",
                                   "*.safetensors"])
def test_an_index_naming_files_outside_the_snapshot_is_refused(tmp_path, tiny_files, shard):
    hf_home = tmp_path / "hf"
    files = small_only(tiny_files)
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": 10}, "weight_map": {"lm_head.weight": shard}}).encode()
    add_snapshot(hf_home, "Org/Tiny-Model", MAIN, files, refs=("main",))
    out = run_acquire("Org/Tiny-Model", hf_home)
    assert not out["ok"] and out["exit_code"] == EXIT_USAGE and "weight_map" in out["error"], out


@pytest.mark.parametrize("listed", ["*.safetensors", "[a-z]*.bin", "model?.safetensors", "a\\b.safetensors"])
def test_a_listing_naming_glob_or_odd_files_is_never_a_download_pattern(tmp_path, listed):
    """A hub's listing names the weight files (no index): a '*' there would fetch every file past the size policy."""
    from agent.migrate.checkpoint_files import _plan_weights

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(hub_refs.BadHubReference, match="file listing"):
        _plan_weights(tmp_path, {"config.json": 2, listed: 10})
