"""What a run keeps beyond its process: the checkpoint store (what --resume continues) and, for a
migration, the staging folder where vendor and render write the recipe before it appears whole in the
output folder (`publish`). A migration killed before that leaves nothing in the output folder (nothing in
a checkout); one killed after it leaves the whole recipe, which --resume continues and rollback undoes."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from agent import errors
from agent.paths import outer_tempdir
from agent.recipe.backup import real_dirs
from agent.recipe.fs_guard import user_tree
from agent.recipe.targets import checkout_root, state_parts


def store_dir(home: Path, output_dir: Path) -> Path:
    """Where the run's checkpoint store and lock live: `.migrator/` of the recipe (B/C), or of the
    output dir (A). A migration into a cann-recipes-infer checkout's models/ keeps them outside the
    checkout, in this user's folder under the temporary directory (one per output dir), so that a run
    leaves nothing of ours at the checkout's models root on any exit, a killed one included (upstream's
    validate_infer_args.py lists every folder there as a model); --resume finds them there again."""
    if home != output_dir or checkout_root(output_dir) is None:
        return real_dirs(home, *state_parts(home))   # a symlinked .migrator is refused, never written through
    # outside every process tree's own temporary folder (`migrator standin -- migrator run` runs this
    # in one, removed when the tree ends): --resume finds it again after any exit
    base = outer_tempdir() / f"infer-migrator-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(base)
    if base.is_symlink() or not base.is_dir() or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise errors.InputError(f"{base} is not a private folder of this user; the migrator keeps a checkout "
                                "migration's resume store there: remove it, then re-run")
    return real_dirs(base, "checkouts", hashlib.sha256(str(output_dir).encode()).hexdigest()[:16], ".migrator")


def _staging_root(recipe_dir: Path) -> tuple[Path, Path]:
    """(the migration's store, the staging folder of `recipe_dir` in it: staging/<key>/)."""
    output_dir = Path(recipe_dir).parent
    store = store_dir(output_dir, output_dir)
    return store, store / "staging" / hashlib.sha256(str(recipe_dir).encode()).hexdigest()[:16]


def staging_dir(recipe_dir: Path) -> Path:
    """Where vendor and render write `recipe_dir` before it is published: in its migration's store, beside
    the --resume checkpoints (a resumed run finds what the killed one wrote), one per recipe folder (whose
    folder lock the migration holds). Made if missing."""
    store, folder = _staging_root(recipe_dir)
    return real_dirs(store, *folder.relative_to(store).parts) / Path(recipe_dir).name


def drop_staging(recipe_dir: Path) -> None:
    """The staging folder of `recipe_dir`, gone (published, or a failed migration's)."""
    store, folder = _staging_root(recipe_dir)
    user_tree(store, "the run's state folder").rmtree(folder)


def publish(staging: Path, recipe_dir: Path) -> None:
    """The staged recipe moved into place whole: one rename onto `recipe_dir` (absent, or the empty folder
    the migration was told to fill; the output folder's tree resolves it: no link on the way). Across
    filesystems it is copied beside it first, into a hidden folder this process holds (owned_temp), then
    renamed: no command ever sees half a recipe. A `recipe_dir` that holds only the checkpoints the migration
    wrote for its recipe to run (agent.recipe.targets.run_checkpoints_dir: a conversion, --quantize's output, a
    view; written where the recipe runs them, on its filesystem, before the recipe exists) gives them to the
    staged recipe's state folder first, one rename (restore_run_checkpoints takes them back after a kill)."""
    from agent.processes import owned_temp, remove_orphaned_temp

    tree = user_tree(recipe_dir.parent, "the output folder")
    real = tree.resolve(recipe_dir, "rename", follow=False)
    held = held_run_checkpoints(recipe_dir)
    try:
        if held is not None:
            _adopt_run_checkpoints(recipe_dir, held, staging)
        os.rename(staging, real)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise errors.InputError(f"{recipe_dir}: the migrated recipe cannot be put in place ({exc.strerror}); "
                                    "move what is there away and run the same command again") from None
        remove_orphaned_temp(recipe_dir.parent)       # one a killed publish left
        with owned_temp("publish", recipe_dir.parent, hidden=True) as aside:
            tree.copy_tree(staging, aside)
            if held is not None:
                _adopt_run_checkpoints(recipe_dir, held, aside)
            tree.replace(aside, recipe_dir)
    drop_staging(recipe_dir)


def held_run_checkpoints(recipe_dir: Path) -> Path | None:
    """The run checkpoints folder of `recipe_dir` when it is all the folder holds (the migration wrote it before
    publishing), else None (absent, empty, or holding anything else: not this migration's to move)."""
    from agent.recipe.targets import RUN_CHECKPOINTS

    parts = (*state_parts(recipe_dir), RUN_CHECKPOINTS)
    folder = Path(recipe_dir)
    for part in parts:
        try:
            entries = [entry.name for entry in os.scandir(folder)]
        except OSError:
            return None
        if entries != [part] or (folder / part).is_symlink() or not (folder / part).is_dir():
            return None
        folder = folder / part
    return folder


def _adopt_run_checkpoints(recipe_dir: Path, held: Path, into: Path) -> None:
    """`held` (recipe_dir's run checkpoints) renamed into the staged recipe `into` at the same place, then the
    state folders it leaves empty and `recipe_dir` itself removed: the staged recipe is renamed onto its place."""
    from agent.recipe.targets import RUN_CHECKPOINTS

    parts = state_parts(recipe_dir)
    os.rename(held, real_dirs(into, *parts) / RUN_CHECKPOINTS)
    tree = user_tree(recipe_dir.parent, "the output folder")
    if any(not entry.is_dir() for entry in Path(recipe_dir).rglob("*")):
        raise errors.InputError(f"{recipe_dir}: a file appeared in it while the migration published its recipe; move "
                                "it away and run the same command again")
    tree.rmtree(recipe_dir)          # only the empty state folders are left


def restore_run_checkpoints(recipe_dir: Path) -> None:
    """A publish killed between giving the run checkpoints to the staging folder and renaming it onto
    `recipe_dir`: the checkpoints go back where the run plan names them (--resume renders again)."""
    from agent.recipe.targets import RUN_CHECKPOINTS, run_checkpoints_dir

    staged = staging_dir(recipe_dir).joinpath(*state_parts(recipe_dir), RUN_CHECKPOINTS)
    if not staged.is_dir() or staged.is_symlink() or run_checkpoints_dir(recipe_dir).exists():
        return
    tree = user_tree(recipe_dir.parent, "the output folder")
    tree.mkdir(run_checkpoints_dir(recipe_dir).parent)
    os.rename(staged, tree.resolve(run_checkpoints_dir(recipe_dir), "rename", follow=False))
