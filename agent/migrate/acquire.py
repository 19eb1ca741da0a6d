"""Resolve what the user gave (HF link, Org/Name, ModelScope link, local dir) to a local checkpoint directory.

ModelScope links (and `--hub modelscope Org/Name`, which the CLI turns into one) go to agent.migrate.hub_modelscope,
with the same policy through the `modelscope` library and its cache. Every checkpoint is then held to
agent.migrate.transformers_range (an architecture the installed transformers is too old for: exit 3).

Hub downloads go through huggingface_hub, which honours HF_ENDPOINT (mirrors), HF_HOME and
HF_HUB_OFFLINE. Small files (config, tokenizer, generation config, `*.py`) first; then the weights,
only when the bytes still to download (sizes from metadata, read before downloading) are < 5 GB.
Otherwise the user is asked for `--weights PATH` (exit code EXIT_NEEDS_WEIGHTS).

Where the weight sizes come from, most trusted first:
1. online: `snapshot_download(dry_run=True)`, the hub's own account of what a download would fetch;
2. the tree listing huggingface_hub caches per commit (`models--Org--Name/trees/<commit>.json`), written
   from the Hub's own file listing by any earlier online `snapshot_download` (this run's first call when
   online): exact sizes for every file of that commit, usable offline;
3. online: `get_safetensors_metadata` (tensor bytes per file, from the safetensors headers);
4. the cached snapshot itself: sizes of weight files already there, and for absent shards the
   `metadata.total_size` of `model.safetensors.index.json` (tensor bytes written by `save_pretrained`).
When none says how big the missing weights are, nothing is downloaded.

Every failure is a one-line MigratorError (never a traceback): InputError (exit 2) for bad links,
repos/revisions not found, caches that miss what is needed; exit 5 for weights too large to fetch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from agent.migrate.checkpoint_files import (SMALL_FILE_PATTERNS, WEIGHT_INDEXES, WEIGHT_SUFFIXES,  # noqa: F401 - re-exported
                                    WEIGHTS_LIMIT_BYTES, Acquired, _check_shards, _merge_weights, _plan_weights,
                                    check_download_size,
                                    _weights_dir)
from agent.errors import InputError, MigratorError
from agent.migrate.hub_refs import BadHubReference, checked_repo_id, checked_revision, inside_cache_tree

REPO_ID_RE = re.compile(r"^(?P<org>[\w.-]+)/(?P<name>[\w.-]+)$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
CANONICAL_HOST = "https://huggingface.co"


@dataclass
class HubRef:
    repo_id: str
    revision: str | None
    url: str           # canonical https://huggingface.co/Org/Name[/tree/<rev>] or https://modelscope.cn/models/...
    hub: str = "hf"    # "hf" or "modelscope" (agent.migrate.hub_modelscope)

    def __post_init__(self):
        # every reference, however it was built, holds a decoded, valid repo id and revision (hub_refs)
        hub = "ModelScope" if self.hub == "modelscope" else "Hugging Face"
        self.repo_id = checked_repo_id(self.repo_id, self.repo_id, hub)
        self.revision = checked_revision(self.revision, self.repo_id)


def parse_hub_ref(text: str) -> HubRef | None:
    """A model repo reference, or None when `text` is not one.

    Accepted: `https://huggingface.co/Org/Name` (also `hf.co`, the host of HF_ENDPOINT, or no scheme),
    with `/tree/<rev>`, `/blob/<rev>/<file>`, `/resolve/<rev>/<file>` (the file is ignored: the whole
    model is meant); `hf://Org/Name[@rev]`; and `Org/Name`. ModelScope links
    (`https://modelscope.cn/models/Org/Name[...]`, agent.migrate.hub_modelscope) give a ref with hub="modelscope".
    Dataset/space links, other hosts and malformed ids give None (`hub_ref_problem` says why). A hub
    reference whose revision or repo id is unsafe (`..`, an absolute path, control characters, after
    URL-decoding: agent.migrate.hub_refs) raises BadHubReference (an InputError, exit 2).
    """
    return _parse(text)[0]


def hub_ref_problem(text: str) -> str | None:
    """Why `text` is not a model repo reference (None when it is one, or is not link-like at all)."""
    try:
        return _parse(text)[1]
    except BadHubReference as exc:
        return str(exc)


def _parse(text: str) -> tuple[HubRef | None, str | None]:
    text = text.strip()
    if not text:
        return None, None
    from agent.migrate import hub_modelscope

    if hub_modelscope.is_modelscope_link(text):
        parsed, problem = hub_modelscope.parse(text)
        if parsed is None:
            return None, problem
        repo_id = checked_repo_id(parsed[0], text, "ModelScope")
        revision = checked_revision(parsed[1], text)
        return HubRef(repo_id, revision, hub_modelscope.canonical_url(repo_id, revision), "modelscope"), None
    try:
        from huggingface_hub import constants, parse_hf_uri
        from huggingface_hub.errors import HfUriError, HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None, "huggingface_hub is not installed"
    lowered = text.lower()
    if "://" in lowered and not lowered.startswith(("http://", "https://", "hf://")):
        return None, f"unsupported scheme {text.split('://', 1)[0]!r}"
    # Links: with a scheme, or scheme-less on a Hub host (huggingface.co, hf.co, HF_ENDPOINT's host).
    if "://" in lowered or lowered.split("/", 1)[0] in constants.HF_URL_HOSTS:
        try:
            uri = parse_hf_uri(text, endpoint=constants.ENDPOINT)
        except (HfUriError, HFValidationError) as exc:
            return None, _one_line(str(exc))
        if uri.type != "model":
            return None, f"a {uri.type} repository, not a model"
        return _ref(checked_repo_id(uri.id, text), checked_revision(uri.revision, text)), None
    match = REPO_ID_RE.match(text)
    if not match or text.startswith((".", "~")):
        return None, None
    try:
        validate_repo_id(text)
    except HFValidationError as exc:
        return None, _one_line(str(exc))
    return _ref(text, None), None


def _ref(repo_id: str, revision: str | None) -> HubRef:
    url = f"{CANONICAL_HOST}/{repo_id}"
    if revision:
        url += f"/tree/{quote(revision, safe='')}"
    return HubRef(repo_id, revision, url)


def hub_target(target: str, hub: str | None) -> str:
    """The workflow's target for `--hub HUB TARGET`: a ModelScope id becomes its canonical link (the link
    is what --resume reads and the baseline records); a link must be on the hub named."""
    if hub is None or Path(target).expanduser().exists():
        return target
    from agent.migrate import hub_modelscope

    text = target.strip()
    on_modelscope = hub_modelscope.is_modelscope_link(text)
    if hub == "hf":
        if on_modelscope:
            raise InputError(f"{target}: a ModelScope link, but --hub hf was given; drop --hub or use --hub modelscope")
        return target
    if on_modelscope:
        return target
    from huggingface_hub import constants

    if "://" in text or text.lower().split("/", 1)[0] in constants.HF_URL_HOSTS:
        raise InputError(f"{target}: not a ModelScope link, but --hub modelscope was given; give Org/Name or "
                         "https://modelscope.cn/models/Org/Name")
    problem = local_path_problem(target) or hub_modelscope.id_problem(text)
    if problem:
        raise InputError(problem)
    return hub_modelscope.canonical_url(text, None)


def acquire(target: str, weights: str | None = None) -> Acquired:
    from agent.migrate.transformers_range import check_checkpoint_supported

    got = _acquire(target, weights)
    check_checkpoint_supported(got.model_dir)
    return got


def _acquire(target: str, weights: str | None) -> Acquired:
    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{target}: not a directory; give a Hugging Face model directory, "
                             "an https://huggingface.co/Org/Name link or Org/Name")
        if not (path / "config.json").is_file():
            raise InputError(f"{target}: no config.json — point at a Hugging Face model directory "
                             "(the folder that holds config.json and the weights)")
        return Acquired(path.resolve(), str(path.resolve()), path.resolve().name)
    local = local_path_problem(target)
    if local:
        raise InputError(local)
    ref, problem = _parse(target)
    if ref is None:
        why = f" ({problem})" if problem else ""
        raise InputError(_one_line(f"{target}: no such directory, and not a Hugging Face model link "
                                   f"(https://huggingface.co/Org/Name[/tree/<rev>]), repo id (Org/Name) or "
                                   f"ModelScope link (https://modelscope.cn/models/Org/Name){why}"))
    if ref.hub == "modelscope":
        from agent.migrate import hub_modelscope

        return hub_modelscope.download(ref, weights)
    return download(ref, weights)


def name_hint(target: str) -> str | None:
    """The recipe name `acquire` derives (before normalisation), when it can be told without fetching
    anything: a local folder's name, a hub repository's; None otherwise."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path.resolve().name
    if path.exists() or local_path_problem(target):
        return None
    ref, _problem = _parse(target)
    return ref.repo_id.split("/")[-1] if ref is not None else None


def local_path_problem(target: str) -> str | None:
    """A missing local path that would otherwise be read as a hub repo id (`ckpt/nonexist` while
    ./ckpt exists, `./x`, `~/x`, `/x`): say it is missing instead of asking the hub for it."""
    text = target.strip()
    path = Path(text).expanduser()
    if path.exists():
        return None
    first = text.split("/", 1)[0]
    explicit = text.startswith(("./", "../", "/", "~", ".\\"))
    if explicit or (first not in ("", ".", "..") and "/" in text and Path(first).is_dir()
                    and "://" not in text):
        parent = next((p for p in [path, *path.parents] if p.exists()), None)
        hint = f" ({parent} exists)" if parent not in (None, Path("."), Path("/")) else ""
        link = "" if explicit else f"; for the hub repo write https://huggingface.co/{text}"
        return f"{target}: no such directory{hint}{link}"
    return None


# ---- hub ----------------------------------------------------------------------------------
def download(ref: HubRef, weights: str | None) -> Acquired:
    from huggingface_hub import constants, snapshot_download

    name = ref.repo_id.split("/")[-1]
    weights_dir = _weights_dir(weights) if weights else None
    if weights_dir is not None and (weights_dir / "config.json").is_file():
        # A complete checkpoint (config + weights): nothing to fetch.
        return Acquired(weights_dir, ref.url, name)

    with _hub_errors(ref, stage="config and tokenizer"):
        small_dir = Path(snapshot_download(ref.repo_id, revision=ref.revision,
                                           allow_patterns=SMALL_FILE_PATTERNS))
    small_dir = inside_cache_tree(small_dir, constants.HF_HUB_CACHE, _label(ref))
    if not (small_dir / "config.json").is_file():
        raise InputError(f"{_label(ref)}: the repository has no config.json at this revision; "
                         "it is not a transformers model")
    if weights_dir is None:
        _check_servable_before_weights(ref, small_dir)
    if weights_dir is not None:
        model_dir = _merge_weights(ref, small_dir, weights_dir)
        _check_shards(model_dir, f"--weights {weights}")
        return Acquired(model_dir, ref.url, name)

    commit = small_dir.name if COMMIT_RE.match(small_dir.name) else None
    listing = _listing(ref, commit)
    files, _total, to_fetch, fetch_bytes = _plan_weights(small_dir, listing)
    if not files and listing is None:
        raise _missing_weights(ref, [], _offline_reason())
    if not files:
        raise InputError(f"{_label(ref)}: the repository has no weight files (*.safetensors / *.bin) at "
                         "this revision; pass --weights PATH with the weights")
    check_download_size(_label(ref), files, to_fetch, fetch_bytes, f"hf download {ref.repo_id} --local-dir DIR")
    if to_fetch and fetch_bytes is None:
        raise _missing_weights(ref, to_fetch, "no metadata gives their size, so nothing was downloaded")
    model_dir = small_dir
    if to_fetch:
        with _hub_errors(ref, stage="weights", weights=to_fetch):
            model_dir = Path(snapshot_download(ref.repo_id, revision=commit or ref.revision,
                                               allow_patterns=SMALL_FILE_PATTERNS + to_fetch))
        model_dir = inside_cache_tree(model_dir, constants.HF_HUB_CACHE, _label(ref))
        still = [f for f in to_fetch if not (model_dir / f).is_file()]
        if still:
            raise _missing_weights(ref, still, _offline_reason())
    return Acquired(model_dir, ref.url, name)


def _check_servable_before_weights(ref: HubRef, small_dir: Path) -> None:
    """A checkpoint its config already refuses (quantized, encoder-decoder: agent.migrate.vendor.check_servable)
    is refused before its weights are fetched or asked for: the line says what to do with them instead."""
    from agent.migrate.vendor import check_servable
    from engine.safe_load import LoadError, load_json

    try:
        config = load_json(small_dir / "config.json")
    except (OSError, LoadError):
        return                  # a config that cannot be read: the checkpoint check says so where it arrives
    if isinstance(config, dict):
        check_servable(config, download=f"hf download {ref.repo_id} --local-dir DIR")


def _listing(ref: HubRef, commit: str | None) -> dict[str, int] | None:
    """{repo path: size} of the commit's weight files and indexes from hub metadata; None when none is at hand.

    Online: `snapshot_download(dry_run=True)` (the hub's own answer to what a download would fetch, sizes
    included, nothing written); then the tree listing huggingface_hub cached for the commit; then
    `get_safetensors_metadata` (tensor bytes per safetensors file, read with range requests). Offline:
    the cached tree listing only; without it the caller falls back to the index's total_size."""
    from huggingface_hub import constants

    revision = commit or ref.revision
    online = not constants.HF_HUB_OFFLINE
    if online:
        listing = _dry_run_listing(ref, revision)
        if listing is not None:
            return listing
    listing = _cached_tree_listing(ref, revision)
    if listing is not None or not online:
        return listing
    return _safetensors_listing(ref, revision)


WEIGHT_METADATA_PATTERNS = ["*.safetensors", "*.bin", "*.json"]


def _dry_run_listing(ref: HubRef, revision: str | None) -> dict[str, int] | None:
    from huggingface_hub import snapshot_download

    try:
        infos = snapshot_download(ref.repo_id, revision=revision, allow_patterns=WEIGHT_METADATA_PATTERNS,
                                  dry_run=True)
    except Exception:  # noqa: BLE001 - metadata is optional: the cache and the index are the fallbacks
        return None
    if not infos or any(info.file_size is None for info in infos):
        return None
    return {info.filename: int(info.file_size) for info in infos}


def _cached_tree_listing(ref: HubRef, revision: str | None) -> dict[str, int] | None:
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path: int(f.size or 0) for f in get_cached_repo_tree(ref.repo_id, revision=revision)}
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None


def _safetensors_listing(ref: HubRef, revision: str | None) -> dict[str, int] | None:
    """Tensor bytes of each safetensors file (header excluded: a lower bound by a few KB)."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(ref.repo_id, revision=revision)
    except Exception:  # noqa: BLE001 - not a safetensors repo, or the hub cannot be reached
        return None
    return {name: max((t.data_offsets[1] for t in fm.tensors.values()), default=0)
            for name, fm in meta.files_metadata.items()} or None


class _hub_errors:
    """Turn huggingface_hub failures into one-line InputErrors."""

    def __init__(self, ref: HubRef, stage: str, weights: list[str] | None = None):
        self.ref, self.stage, self.weights = ref, stage, weights

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, MigratorError):
            return False
        raise self.translate(exc) from exc

    def translate(self, exc: Exception) -> MigratorError:
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            DisabledRepoError, GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
            LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

        label, endpoint = _label(self.ref), constants.ENDPOINT
        if self.weights is not None and isinstance(exc, LocalEntryNotFoundError):
            return _missing_weights(self.ref, self.weights, _offline_reason())
        if isinstance(exc, IncompleteSnapshotError):
            return InputError(f"{label}: the cached snapshot in {constants.HF_HUB_CACHE} lacks some of the "
                              f"{self.stage} files and {_offline_reason()}; rerun with hub access "
                              "(HF_ENDPOINT for a mirror) or pass a local model directory")
        if isinstance(exc, LocalEntryNotFoundError):
            fix = ("unset HF_HUB_OFFLINE (with network) or set HF_ENDPOINT to a reachable mirror"
                   if constants.HF_HUB_OFFLINE else "check the network or set HF_ENDPOINT to a reachable mirror")
            return InputError(f"{label}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              f"{_offline_reason()}; {fix}, or download the model and pass its directory")
        if isinstance(exc, GatedRepoError):
            return InputError(f"{label}: gated repository on {endpoint}; accept its terms on the model page "
                              "and set HF_TOKEN")
        if isinstance(exc, RepositoryNotFoundError):
            return InputError(f"{label}: repository not found on {endpoint} (or private: set HF_TOKEN)")
        if isinstance(exc, RevisionNotFoundError):
            return InputError(f"{label}: revision {self.ref.revision or 'main'!r} not found on {endpoint}")
        if isinstance(exc, DisabledRepoError):
            return InputError(f"{label}: repository disabled on {endpoint}")
        if isinstance(exc, HfHubHTTPError):
            status = getattr(getattr(exc, "response", None), "status_code", None)
            return InputError(f"{label}: hub request to {endpoint} failed"
                              f"{f' (HTTP {status})' if status else ''} while fetching {self.stage}; check the "
                              "link, the revision, HF_TOKEN and HF_ENDPOINT")
        if isinstance(exc, (HFValidationError, ValueError)):
            return InputError(_one_line(f"{label}: {exc}"))
        return InputError(_one_line(f"{label}: fetching {self.stage} from {endpoint} failed: "
                                    f"{exc.__class__.__name__}: {exc}"))


def _missing_weights(ref: HubRef, files: list[str], reason: str) -> InputError:
    from huggingface_hub import constants

    sample = ", ".join(files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
    sample = sample or "no *.safetensors / *.bin file there"
    return InputError(f"{_label(ref)}: config and tokenizer are cached but the weights are missing from the "
                      f"local Hugging Face cache ({constants.HF_HUB_CACHE}): {sample}; {reason}. Rerun with hub "
                      "access (HF_ENDPOINT for a mirror) or pass --weights PATH")


def _offline_reason() -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return f"the hub ({constants.ENDPOINT}) cannot be reached"


def _label(ref: HubRef) -> str:
    return ref.repo_id + (f"@{ref.revision}" if ref.revision else "")


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


