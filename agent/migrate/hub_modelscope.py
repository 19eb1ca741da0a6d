"""ModelScope (modelscope.cn) as a model source, through the `modelscope` library and its own cache.

Accepted references: `https://modelscope.cn/models/Org/Name` (also `www.`, `modelscope.ai`, the host of
MODELSCOPE_ENDPOINT, or no scheme), with `/summary`, `/files`, `/tree/<rev>`, `/file/view/<rev>/<file>`,
`/resolve/<rev>/<file>` or `?revision=<rev>`; and `Org/Name` with `--hub modelscope` (the CLI turns that
into the canonical link, which is also what the baseline records as model_source).

The same policy as the Hugging Face path (agent.migrate.acquire): small files first (config, tokenizer, generation
config, `*.py`), then the weights only when the bytes still to fetch are < 5 GB, otherwise exit 5 and ask
for `--weights PATH`. Sizes come from the repo's file listing online (`HubApi.get_model_files`), and
offline (ModelScope keeps no listing in its cache) from the weight files already cached plus the
`metadata.total_size` of the safetensors / bin index.

Environment, read by the modelscope library itself: MODELSCOPE_ENDPOINT (a mirror; the deprecated
MODELSCOPE_DOMAIN too), MODELSCOPE_CACHE (the cache root, default ~/.cache/modelscope; both its layouts,
`models/Org--Name/snapshots/<rev>/` and the pre-1.38 `hub/models/Org/Name/`, are read), MODELSCOPE_API_TOKEN.
modelscope has no offline switch of its own: HF_HUB_OFFLINE=1 or MODELSCOPE_OFFLINE=1 makes this path
cache-only (`local_files_only=True`); online, a hub that cannot be reached falls back to the cache, as
huggingface_hub does.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from agent.errors import InputError, MigratorError

CANONICAL_HOST = "https://modelscope.cn"
HOSTS = ("modelscope.cn", "www.modelscope.cn", "modelscope.ai", "www.modelscope.ai")
DEFAULT_REVISION = "master"
NAME_RE = re.compile(r"^[\w.-]+$")
PAGE_PATHS = {"summary", "files", "feedback", "dataPeview", "picture"}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def offline() -> bool:
    return _truthy("HF_HUB_OFFLINE") or _truthy("MODELSCOPE_OFFLINE")


def endpoint() -> str:
    raw = os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN") or CANONICAL_HOST
    raw = raw.strip().rstrip("/")
    return raw if "://" in raw else f"https://{raw}"


def cache_root() -> Path:
    return Path(os.environ.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope").expanduser()


def hosts() -> tuple[str, ...]:
    own = (urlsplit(endpoint()).netloc or "").lower()
    return HOSTS + ((own,) if own and own not in HOSTS else ())


def canonical_url(repo_id: str, revision: str | None) -> str:
    url = f"{CANONICAL_HOST}/models/{repo_id}"
    return url + (f"/tree/{quote(revision, safe='')}" if revision else "")


def is_modelscope_link(text: str) -> bool:
    text = text.strip()
    lowered = text.lower()
    rest = lowered.split("://", 1)[1] if "://" in lowered else lowered
    return rest.split("/", 1)[0] in hosts()


def parse(text: str) -> tuple[tuple[str, str | None] | None, str | None]:
    """(repo_id, revision) of a ModelScope model link, or (None, why not)."""
    text = text.strip()
    lowered = text.lower()
    if "://" in lowered and not lowered.startswith(("http://", "https://")):
        return None, f"unsupported scheme {text.split('://', 1)[0]!r}"
    parts = urlsplit(text if "://" in text else "https://" + text)
    segs = [s for s in parts.path.split("/") if s]
    if not segs or segs[0] != "models":
        kind = segs[0] if segs else "no path"
        return None, f"a ModelScope {kind!r} page, not a model (https://modelscope.cn/models/Org/Name)"
    if len(segs) < 3:
        return None, "a ModelScope model link needs /models/Org/Name"
    org, name, rest = segs[1], segs[2], segs[3:]
    problem = id_problem(f"{org}/{name}")
    if problem:
        return None, problem
    revision = None
    if rest[:1] in (["tree"], ["resolve"]) or rest[:2] == ["file", "view"]:
        at = 2 if rest[0] == "file" else 1
        if len(rest) <= at:
            return None, f"/{'/'.join(rest)} without a revision"
        revision = rest[at]
    elif rest[:1] == ["files"]:
        revision = rest[1] if len(rest) > 1 else None
    elif rest and rest[0] not in PAGE_PATHS:
        return None, f"unknown ModelScope model page /{rest[0]}"
    query = {k.lower(): v[0] for k, v in parse_qs(parts.query).items()}
    revision = query.get("revision") or revision
    if revision is not None and (not revision.strip() or any(c in revision for c in "\0\n\r\t")):
        return None, f"bad revision {revision!r}"
    return (f"{org}/{name}", revision), None


def id_problem(repo_id: str) -> str | None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        return f"{repo_id!r} is not a ModelScope model id (Org/Name)"
    for part in parts:
        if not NAME_RE.match(part) or part in (".", "..") or part.startswith(".") or len(part) > 96:
            return f"{repo_id!r} is not a ModelScope model id (letters, digits, '-', '_', '.')"
    return None


# ---- download ------------------------------------------------------------------------------
def download(ref, weights: str | None):
    """The ModelScope counterpart of agent.migrate.acquire.download, for a ref with hub="modelscope"."""
    from agent.migrate.checkpoint_files import (SMALL_FILE_PATTERNS, Acquired, _check_shards, check_download_size,
                                        _merge_weights, _plan_weights, _weights_dir)

    _quiet()
    name = ref.repo_id.split("/")[-1]
    weights_dir = _weights_dir(weights) if weights else None
    if weights_dir is not None and (weights_dir / "config.json").is_file():
        return Acquired(weights_dir, ref.url, name)
    small_dir, is_offline = _snapshot(ref, SMALL_FILE_PATTERNS, "config and tokenizer")
    if not (small_dir / "config.json").is_file():
        if is_offline:
            raise InputError(f"{_label(ref)}: the cached snapshot {small_dir} has no config.json and "
                             f"{_offline_reason()}; rerun with hub access or pass a local model directory")
        raise InputError(f"{_label(ref)}: the repository has no config.json at this revision; it is not a "
                         "transformers model")
    if weights_dir is not None:
        model_dir = _merge_weights(ref, small_dir, weights_dir)
        _check_shards(model_dir, f"--weights {weights}")
        return Acquired(model_dir, ref.url, name)

    listing = None if is_offline else _listing(ref)
    files, _total, to_fetch, fetch_bytes = _plan_weights(small_dir, listing)
    if not files:
        if listing is None:
            raise _missing_weights(ref, [], small_dir, _offline_reason() if is_offline else
                                   "the file listing could not be read")
        raise InputError(f"{_label(ref)}: the repository has no weight files (*.safetensors / *.bin) at this "
                         "revision; pass --weights PATH with the weights")
    check_download_size(_label(ref), files, to_fetch, fetch_bytes, f"modelscope download --model {ref.repo_id} --local_dir DIR")
    if to_fetch and is_offline:
        raise _missing_weights(ref, to_fetch, small_dir, _offline_reason())
    if to_fetch and fetch_bytes is None:
        raise _missing_weights(ref, to_fetch, small_dir, "no metadata gives their size, so nothing was downloaded")
    model_dir = small_dir
    if to_fetch:
        model_dir, is_offline = _snapshot(ref, SMALL_FILE_PATTERNS + to_fetch, "weights")
        still = [f for f in to_fetch if not (model_dir / f).is_file()]
        if still:
            raise _missing_weights(ref, still, model_dir, _offline_reason())
    return Acquired(model_dir, ref.url, name)


def _snapshot(ref, patterns: list[str], stage: str) -> tuple[Path, bool]:
    """The snapshot dir (and whether it came from the cache only). Online failures to reach the hub fall
    back to the cache."""
    from modelscope import snapshot_download

    from agent.migrate.hub_refs import inside_cache_tree

    if not offline():
        try:
            got = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=patterns)
        except Exception as exc:  # noqa: BLE001 - translated below; only "unreachable" falls back to the cache
            if not _unreachable(exc):
                raise _translate(ref, exc, stage) from None
            reason = f"the hub ({endpoint()}) cannot be reached"
        else:
            return inside_cache_tree(got, cache_root(), _label(ref)), False
    else:
        reason = _offline_reason()
    try:
        got = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=patterns, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        if type(exc).__name__ == "CacheNotFound":
            fix = ("unset HF_HUB_OFFLINE / MODELSCOPE_OFFLINE (with network) or set MODELSCOPE_ENDPOINT to a "
                   "reachable mirror" if offline() else "check the network or set MODELSCOPE_ENDPOINT to a reachable mirror")
            detail = _one_line(str(exc)).split("disabled.", 1)[-1].strip().rstrip(".")
            raise InputError(f"{_label(ref)}: not in the local ModelScope cache ({cache_root()}) and {reason}"
                             f"{f' ({detail})' if detail else ''}; {fix}, or download the model and pass its "
                             "directory") from None
        raise _translate(ref, exc, stage) from None
    return inside_cache_tree(got, cache_root(), _label(ref)), True


def _listing(ref) -> dict[str, int] | None:
    """{path: size} of the repo's files at the revision, from the hub's listing; None when unavailable."""
    try:
        from modelscope.hub.api import HubApi

        files = HubApi().get_model_files(ref.repo_id, revision=ref.revision or DEFAULT_REVISION, recursive=True)
        listing = {str(f["Path"]): int(f["Size"]) for f in files if f.get("Size") is not None}
        return listing if listing and len(listing) == len(files) else None
    except Exception:  # noqa: BLE001 - sizes are optional: the index is the fallback
        return None


def _unreachable(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"NetworkError", "ConnectionError", "Timeout", "RequestTimeoutError", "ConnectTimeout"})


def _translate(ref, exc: BaseException, stage: str) -> MigratorError:
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = _one_line(str(exc))
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if names & {"AuthenticationError", "PermissionDeniedError"} or status in (401, 403):
        return InputError(f"{_label(ref)}: access denied on {endpoint()}; set MODELSCOPE_API_TOKEN for a private "
                          "or gated model")
    if names & {"NotExistError", "HTTPError", "NoValidRevisionError"} or status == 404:
        what = f"revision {ref.revision!r} or repository" if ref.revision else "repository"
        return InputError(f"{_label(ref)}: {what} not found on {endpoint()} ({text[:200]})")
    if "FileDownloadError" in names:
        return InputError(f"{_label(ref)}: downloading the {stage} files from {endpoint()} failed ({text[:200]}); "
                          "rerun, or download the model and pass its directory")
    return InputError(f"{_label(ref)}: fetching the {stage} from {endpoint()} failed: "
                      f"{type(exc).__name__}: {text[:300]}")


def _missing_weights(ref, files: list[str], snapshot: Path, reason: str) -> InputError:
    sample = ", ".join(files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
    sample = sample or "no *.safetensors / *.bin file there"
    return InputError(f"{_label(ref)}: config and tokenizer are cached but the weights are missing from the local "
                      f"ModelScope cache ({snapshot}): {sample}; {reason}. Rerun with hub access "
                      "(MODELSCOPE_ENDPOINT for a mirror) or pass --weights PATH")


def _offline_reason() -> str:
    which = [n for n in ("HF_HUB_OFFLINE", "MODELSCOPE_OFFLINE") if _truthy(n)]
    return f"{' and '.join(which)} is set" if which else f"the hub ({endpoint()}) cannot be reached"


def _label(ref) -> str:
    return "modelscope:" + ref.repo_id + (f"@{ref.revision}" if ref.revision else "")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _quiet() -> None:
    """modelscope logs each retry on stderr; our own one-line errors say what happened."""
    try:
        import modelscope  # noqa: F401 - its logger is configured on import; quieten it afterwards
    except ImportError:
        from agent.errors import EnvironmentProblem

        raise EnvironmentProblem("a ModelScope model needs the modelscope library: pip install "
                                 "'infer-migrator[modelscope]' (or pip install modelscope)") from None

    for name in ("modelscope", "modelscope_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
