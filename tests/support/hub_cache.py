"""A Hugging Face cache laid out as huggingface_hub writes it
($HF_HOME/hub/models--Org--Name/{blobs,snapshots,refs}), filled by hand, and agent.migrate.acquire run against
it in a subprocess (huggingface_hub reads HF_HOME / HF_HUB_OFFLINE / HF_ENDPOINT at import time)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from locations import REPO_ROOT


MAIN = "a" * 40


# Runs acquire() and prints one JSON line. snapshot_download is wrapped (not replaced) to record the
# calls the real function receives.
SCRIPT = r"""
import json, sys
import huggingface_hub
from huggingface_hub import constants
calls = []
_real = huggingface_hub.snapshot_download
def _spy(repo_id, **kw):
    calls.append({"repo_id": repo_id, "revision": kw.get("revision"), "allow_patterns": kw.get("allow_patterns")})
    return _real(repo_id, **kw)
huggingface_hub.snapshot_download = _spy
from agent.migrate.acquire import acquire
from agent.errors import MigratorError
try:
    got = acquire(sys.argv[1], weights=sys.argv[2] or None)
    out = {"ok": True, "model_dir": str(got.model_dir), "source": got.source, "name": got.name_hint,
           "files": sorted(p.name for p in got.model_dir.iterdir())}
    cfg = got.model_dir / "config.json"
    out["config"] = json.loads(cfg.read_text()) if cfg.is_file() else None
except MigratorError as exc:
    out = {"ok": False, "error": str(exc), "exit_code": exc.exit_code, "kind": type(exc).__name__}
out.update(calls=calls, endpoint=constants.ENDPOINT, offline=constants.HF_HUB_OFFLINE, cache=constants.HF_HUB_CACHE)
print(json.dumps(out))
"""


def run_acquire(target: str, hf_home: Path, weights: str | None = None, offline: bool = True,
                endpoint: str | None = None, timeout: int = 120) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HF_") and k not in ("TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(hf_home), XDG_CACHE_HOME=str(hf_home.parent / "xdg"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    proc = subprocess.run([sys.executable, "-c", SCRIPT, target, weights or ""], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"acquire crashed:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        assert "\n" not in out["error"], "errors must be one line"
    return out


def add_snapshot(hf_home: Path, repo_id: str, commit: str, files: dict[str, bytes],
                 refs: tuple[str, ...] = (), tree: dict[str, int] | None = None) -> Path:
    """Put `files` in the cache as snapshot `commit` (symlinks into blobs/), point `refs` at it and
    optionally write the tree listing `tree` ({path: size}) for the commit."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / sha
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)   # no trailing newline: read verbatim by huggingface_hub
    if tree is not None:
        (repo / "trees").mkdir(parents=True, exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(json.dumps({
            "format_version": 1,
            "files": {path: {"size": size, "blob_id": hashlib.sha1(path.encode()).hexdigest()}
                      for path, size in tree.items()}}))
    return snapshot


def small_only(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if not name.endswith((".safetensors", ".bin"))}
