"""Resolve what the user gave (HF link, Org/Name, local dir) to a local checkpoint directory.

Hub downloads go through huggingface_hub, which honours HF_ENDPOINT (mirrors), HF_HOME and
HF_HUB_OFFLINE. Small files first; weights only when their total (from metadata) is < 5 GB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agent.errors import EXIT_NEEDS_WEIGHTS, InputError, MigratorError

WEIGHTS_LIMIT_BYTES = 5 * 10**9
SMALL_FILE_PATTERNS = ["*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "tokenizer*", "*.jinja"]
WEIGHT_SUFFIXES = (".safetensors", ".bin")
URL_RE = re.compile(
    r"^https?://(?:www\.)?(?P<host>[^/]+)/(?P<org>[\w.-]+)/(?P<name>[\w.-]+)"
    r"(?:/(?:tree|blob|resolve)/(?P<rev>[^/]+)(?:/.*)?)?/?$")
REPO_ID_RE = re.compile(r"^(?P<org>[\w.-]+)/(?P<name>[\w.-]+)$")


@dataclass
class Acquired:
    model_dir: Path
    source: str        # what the baseline records as model_source
    name_hint: str     # recipe name before normalisation


@dataclass
class HubRef:
    repo_id: str
    revision: str | None
    url: str


def parse_hub_ref(text: str) -> HubRef | None:
    """`https://huggingface.co/Org/Name[/tree|blob/<rev>/...]` or `Org/Name`; None otherwise."""
    match = URL_RE.match(text)
    if match:
        repo_id = f"{match['org']}/{match['name']}"
        url = f"https://huggingface.co/{repo_id}" + (f"/tree/{match['rev']}" if match["rev"] else "")
        return HubRef(repo_id, match["rev"], url)
    match = REPO_ID_RE.match(text)
    if match and not text.startswith((".", "/")):
        return HubRef(text, None, f"https://huggingface.co/{text}")
    return None


def acquire(target: str, weights: str | None = None) -> Acquired:
    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{target}: not a directory; give a Hugging Face model directory, "
                             "an https://huggingface.co/Org/Name link or Org/Name")
        if not (path / "config.json").is_file():
            raise InputError(f"{target}: no config.json — point at a Hugging Face model directory "
                             "(the folder that holds config.json and the weights)")
        return Acquired(path.resolve(), str(path.resolve()), path.resolve().name)
    ref = parse_hub_ref(target)
    if ref is None:
        raise InputError(f"{target}: no such directory, and not a Hugging Face link "
                         "(https://huggingface.co/Org/Name) or repo id (Org/Name)")
    return download(ref, weights)


def download(ref: HubRef, weights: str | None) -> Acquired:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = ref.repo_id.split("/")[-1]
    try:
        model_dir = Path(snapshot_download(ref.repo_id, revision=ref.revision,
                                           allow_patterns=SMALL_FILE_PATTERNS))
        if weights:
            return Acquired(_link_weights(model_dir, Path(weights)), ref.url, name)
        weight_bytes = _weights_size(HfApi(), ref, model_dir)
        if weight_bytes >= WEIGHTS_LIMIT_BYTES:
            raise MigratorError(
                f"{ref.repo_id}: weights are {weight_bytes / 1e9:.1f} GB (>= 5 GB); download them "
                "yourself and pass --weights PATH", exit_code=EXIT_NEEDS_WEIGHTS)
        model_dir = Path(snapshot_download(ref.repo_id, revision=ref.revision))
    except LocalEntryNotFoundError as exc:
        raise InputError(f"{ref.repo_id}: not in the local Hugging Face cache and the hub cannot be "
                         "reached (HF_HUB_OFFLINE set or no network); set HF_ENDPOINT to a mirror or "
                         "download the model and pass its directory") from exc
    except HfHubHTTPError as exc:
        raise InputError(f"{ref.repo_id}: hub request failed ({exc.__class__.__name__}); check the "
                         "link, the revision and HF_TOKEN") from exc
    return Acquired(model_dir, ref.url, name)


def _weights_size(api, ref: HubRef, model_dir: Path) -> int:
    """Total bytes of weight files, from hub metadata (or the cache's snapshot when offline)."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
        files = [(s.rfilename, s.size or 0) for s in info.siblings or []]
    else:
        files = _offline_weight_sizes(model_dir)
    safetensors = [size for name, size in files if name.endswith(".safetensors")]
    return sum(safetensors) if safetensors else sum(size for name, size in files
                                                    if name.endswith(WEIGHT_SUFFIXES))


def _offline_weight_sizes(model_dir: Path) -> list[tuple[str, int]]:
    """Offline: sizes from the weight index's metadata or from the blobs the cache holds."""
    import json

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return [("model.safetensors", int(total))]
    return [(p.name, p.stat().st_size) for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]


def _link_weights(model_dir: Path, weights: Path) -> Path:
    if not weights.is_dir():
        raise InputError(f"--weights {weights}: not a directory")
    return weights.resolve() if (weights / "config.json").is_file() else model_dir
