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
    renamed: no command ever sees half a recipe."""
    from agent.processes import owned_temp, remove_orphaned_temp

    tree = user_tree(recipe_dir.parent, "the output folder")
    real = tree.resolve(recipe_dir, "rename", follow=False)
    try:
        os.rename(staging, real)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise errors.InputError(f"{recipe_dir}: the migrated recipe cannot be put in place ({exc.strerror}); "
                                    "move what is there away and run the same command again") from None
        remove_orphaned_temp(recipe_dir.parent)       # one a killed publish left
        with owned_temp("publish", recipe_dir.parent, hidden=True) as aside:
            tree.copy_tree(staging, aside)
            tree.replace(aside, recipe_dir)
    drop_staging(recipe_dir)
