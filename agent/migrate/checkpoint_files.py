"""What every hub path shares (agent.migrate.acquire for Hugging Face, agent.migrate.hub_modelscope for ModelScope): the
file patterns fetched first, the 5 GB weights policy and its plan, `--weights PATH` merged with a hub's
config and tokenizer, the shard check."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from agent.errors import EXIT_NEEDS_WEIGHTS, InputError, MigratorError
from agent.migrate.hub_refs import checked_filenames
from agent.recipe.fs_guard import user_tree
from engine.safe_load import load_json
from agent.paths import cache_home

WEIGHTS_LIMIT_BYTES = 5 * 10**9
SMALL_FILE_PATTERNS = ["*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "tokenizer*", "*.jinja"]
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHT_INDEXES = (("model.safetensors.index.json", "model.safetensors"),
                  ("pytorch_model.bin.index.json", "pytorch_model.bin"))


@dataclass
class Acquired:
    model_dir: Path
    source: str        # what the baseline records as model_source
    name_hint: str     # recipe name before normalisation


def _plan_weights(snapshot: Path, listing: dict[str, int] | None):
    """(weight files, total bytes or None, files not yet in `snapshot`, bytes to fetch or None)."""
    names = set(listing) if listing is not None else {p.name for p in snapshot.iterdir()}
    files: list[str] = []
    index_total: int | None = None
    for index_name, single in WEIGHT_INDEXES:
        index = snapshot / index_name
        if index_name in names and index.is_file():
            try:
                data = load_json(index)
                files = sorted(set(data["weight_map"].values()))
                index_total = int(data.get("metadata", {}).get("total_size") or 0) or None
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                files, index_total = [], None
            files = checked_filenames(files, f"{snapshot / index_name}: weight_map")   # '..', '/abs', globs
        elif single in names:
            files = [single]
        if files:
            break
    if not files:
        for suffix in WEIGHT_SUFFIXES:
            files = sorted(n for n in names if "/" not in n and n.endswith(suffix))
            if files:
                break
        # names from the hub's listing become download patterns: a '*' or '..' there is refused, never fetched
        files = checked_filenames(files, f"{snapshot}: the repository's file listing")
    to_fetch = [f for f in files if not (snapshot / f).is_file()]
    present = sum((snapshot / f).stat().st_size for f in files if f not in to_fetch)
    if listing is not None:
        sizes = [listing.get(f) for f in files]
        total = sum(s for s in sizes if s) if all(s is not None for s in sizes) else index_total
        fetch = sum(listing.get(f, 0) for f in to_fetch)
        if any(f not in listing for f in to_fetch):
            fetch = None if index_total is None else max(index_total - present, fetch)
        return files, total, to_fetch, fetch
    if not to_fetch:
        return files, present, to_fetch, 0
    if index_total is None:
        return files, None, to_fetch, None
    return files, index_total, to_fetch, max(index_total - present, 0)


# ---- --weights ----------------------------------------------------------------------------
def check_download_size(label: str, files: list, to_fetch: list, fetch_bytes: int | None, download: str) -> None:
    """Weights to download at or over WEIGHTS_LIMIT_BYTES: one line asking the user to fetch them
    (`download`: the hub's own command for it) and pass --weights (exit EXIT_NEEDS_WEIGHTS)."""
    if fetch_bytes is None or fetch_bytes < WEIGHTS_LIMIT_BYTES:
        return
    cached = len(files) - len(to_fetch)
    have = f" ({cached} of {len(files)} files already cached)" if cached else ""
    raise MigratorError(
        f"{label}: weights to download are {fetch_bytes / 1e9:.1f} GB (>= "
        f"{WEIGHTS_LIMIT_BYTES / 1e9:.0f} GB){have}; download them yourself "
        f"(e.g. `{download}`) and pass --weights DIR",
        exit_code=EXIT_NEEDS_WEIGHTS)


def _weights_dir(weights: str) -> Path:
    path = Path(weights).expanduser()
    if not path.is_dir():
        raise InputError(f"--weights {weights}: not a directory")
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir()):
        raise InputError(f"--weights {weights}: no *.safetensors or *.bin weight files in it")
    return path.resolve()


def _merge_weights(ref, small_dir: Path, weights_dir: Path) -> Path:
    """A directory of symlinks: the hub's config/tokenizer files plus the user's weight files.

    Lives under $XDG_CACHE_HOME/infer-migrator (default ~/.cache) so the path stays valid for the recipe.
    """
    root = cache_home() / "infer-migrator" / "checkpoints"
    merged = root / f"{ref.repo_id.replace('/', '--')}--{small_dir.name[:12]}"
    cache_tree = user_tree(root, "the migrator's checkpoint cache", create=True, keep_links=False)
    cache_tree.mkdir(merged)
    for old in merged.iterdir():
        if old.is_symlink() or old.is_file():
            cache_tree.unlink(old)
    for src_dir in (small_dir, weights_dir):   # the user's files win on name clashes
        for src in src_dir.iterdir():
            cache_tree.symlink(src.resolve(), merged / src.name)     # replaces an entry of the same name
    return merged



def _check_shards(model_dir: Path, what: str) -> None:
    for index_name, _ in WEIGHT_INDEXES:
        index = model_dir / index_name
        if index.is_file():
            try:
                shards = sorted(set(load_json(index)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise InputError(f"{what}: {index_name} is not a valid weight index") from None
            shards = checked_filenames(shards, f"{what}: {index_name}: weight_map")
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise InputError(f"{what}: {len(missing)} shard(s) named in {index_name} are missing, "
                                 f"e.g. {missing[0]}")
            return
