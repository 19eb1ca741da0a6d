"""A fuzz pass over every input class (#31.8): checkpoint and recipe trees with links and special files,
the YAML / JSON a recipe carries (its YAMLs, migration_report.json, journals, the run store), tokenizer
files, hub references, --transformers-source archives, the environment variables the tool reads, and
signals at every node of the LangGraph run.

Every example runs the CLI in-process (agent.cli.main) as a user would and holds it to one property: the
documented exit code with exactly one `migrator: error:` line (2 bad input, 3 unsupported, 4 needs an NPU,
10 bad transformers source, 74 unwritable, 75 busy) — never a traceback, never 70 (a bug) or 1 (a failed
recipe) for a file the user gave us, never a hang — and nothing written outside the output folder or the
recipe. An input that is accepted runs the real workflow up to `render` (a recipe written, no trial run);
under `-m slow` the same tests draw more examples (FUZZ_PROFILES). What a pass found is a row of
tests/e2e/test_bad_input.py, fixed where its class goes through."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from agent.paths import demo_model_dir
from locations import REPO_ROOT

@dataclass(frozen=True)
class Profile:
    examples: int
    stop_after: str          # the node an accepted input's run stops after
    derandomize: bool = False  # the same examples every run (make test: a red CI is a finding, never chance)


# the default run stays well under two minutes for the whole file; -m slow draws more and runs further
FUZZ_PROFILES = [pytest.param(Profile(6, "acquire", derandomize=True), id="quick"),
                 pytest.param(Profile(100, "render"), id="long", marks=pytest.mark.slow)]


def fuzz_settings(profile: Profile):
    """No shrinking, no explain phase (its tracer slows a run tenfold): a failure names its example itself.
    FUZZ_EXAMPLES=N overrides the count (a longer hunt by hand)."""
    return settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES") or profile.examples), deadline=None, suppress_health_check=list(HealthCheck),
                    database=None, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                    derandomize=profile.derandomize and not os.environ.get("FUZZ_EXAMPLES"))
HANG_S = 180           # an example that runs longer is a hang (a FIFO opened for reading, a lock waited on)
USER_FAULT_CODES = {2, 3, 4, 10, 74, 75}


class Hung(BaseException):
    """An example ran past HANG_S (raised by SIGALRM; a BaseException, so the CLI cannot swallow it)."""


@dataclass
class Answer:
    code: int | None
    err: str
    out: str
    reached: list[dict] = field(default_factory=list)    # the summaries of the runs the CLI started

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if not ln.startswith("[migrator]")]


def _tree(root: Path, skip: Path) -> dict[str, tuple]:
    """Every entry under root (links not followed) with its kind, size, mtime and mode; `skip` left out."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == skip or skip in here.parents:
            dirnames[:] = []
            continue
        for name in filenames + dirnames:
            path = here / name
            if path == skip:
                continue
            st_ = path.lstat()
            found[str(path.relative_to(root))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns,
                                                  stat.S_IMODE(st_.st_mode), st_.st_nlink)
    return found


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _on_alarm(signum, frame):
    raise Hung()


def run_cli(argv: list[str], root: Path, env: dict[str, str | None] | None = None,
            stop_after: str | None = "render", hang_s: int = HANG_S) -> Answer:
    """`migrator ARGV` in-process, cwd `root`, HF / ModelScope caches and locks under root/out; a run that
    starts stops after `stop_after` (None: runs to the end)."""
    import agent.cli as cli
    from agent.workflow import run as workflow_run

    reached: list[dict] = []
    real = workflow_run.run_migration

    def run_migration(state, resume=False, **kw):
        summary = real(state, resume, stop_after=stop_after, **kw) if stop_after else real(state, resume, **kw)
        reached.append(summary)
        if stop_after and summary.get("status") is None:
            summary = dict(summary, status="ok")          # stopped where asked: not a failure
        return summary

    base = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "out" / "hf"), "HF_HUB_CACHE": None,
            "MODELSCOPE_CACHE": str(root / "out" / "ms"), "XDG_CACHE_HOME": str(root / "out" / "xdg"),
            "MIGRATOR_NO_CODEMOD_CACHE": "1"}
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    old_alarm = signal.signal(signal.SIGALRM, _on_alarm)
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        os.chdir(root)
        with _environment({**base, **(env or {})}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                _patched(cli, "run_migration", run_migration):
            signal.alarm(hang_s)
            try:
                code = cli.main(argv)
            finally:
                signal.alarm(0)
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    return Answer(code, err.getvalue(), out.getvalue(), reached)


@contextlib.contextmanager
def _patched(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def assert_documented_answer(answer: Answer, what: str, runs_workflow: bool = True) -> None:
    """The property every class is held to (see the module docs)."""
    shown = f"{what}\n--- stderr ---\n{answer.err[-3000:]}"
    assert "Traceback" not in answer.err, shown
    if answer.code == 0:
        assert answer.reached or not runs_workflow, shown        # accepted: the workflow ran
        return
    lines = answer.error_lines
    assert len(lines) == 1 and lines[0].startswith("migrator: error: "), shown
    assert answer.code in USER_FAULT_CODES, f"exit {answer.code}: {shown}"


def _example_root(tmp: Path) -> Path:
    root = Path(tempfile.mkdtemp(dir=tmp))
    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("the user's own file\n")
    return root


def _cleanup(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


# ---- file kinds a tree may hold where a file (or a folder) is expected ---------------------------
KINDS = ["symlink_to_outside_copy", "symlink_to_outside_dir", "dangling_symlink", "self_loop", "two_link_loop",
         "fifo", "socket", "link_to_dev_null", "link_to_dev_zero", "link_to_dev_urandom", "directory",
         "directory_with_file", "empty_file", "hard_link_to_outside", "unreadable", "sparse_4_gib", "random_bytes",
         "absolute_link_to_proc_self", "link_to_parent"]


def make_kind(path: Path, kind: str, root: Path, data: bytes, seed: int) -> None:
    """Put `kind` at `path` (whatever was there goes); `data` is what a regular file there would hold."""
    if path.is_symlink() or path.is_file() or path.is_fifo() or path.is_socket():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    outside = root / "outside"
    if kind == "symlink_to_outside_copy":
        copy = outside / f"copy_{seed}_{path.name}"
        copy.write_bytes(data)
        path.symlink_to(copy)
    elif kind == "symlink_to_outside_dir":
        path.symlink_to(outside, target_is_directory=True)
    elif kind == "dangling_symlink":
        path.symlink_to(outside / "no such file")
    elif kind == "self_loop":
        path.symlink_to(path.name)
    elif kind == "two_link_loop":
        other = path.with_name(path.name + ".other")
        if not os.path.lexists(other):
            other.symlink_to(path.name)
        path.symlink_to(other.name)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        try:
            os.chdir(path.parent)          # a socket's path is limited to ~100 bytes: bind relative
            sock.bind(path.name)
        finally:
            os.chdir(here)
            sock.close()
    elif kind.startswith("link_to_dev_"):
        path.symlink_to("/dev/" + kind.removeprefix("link_to_dev_"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "directory_with_file":
        path.mkdir()
        (path / "inner.json").write_bytes(data)
    elif kind == "empty_file":
        path.write_bytes(b"")
    elif kind == "hard_link_to_outside":
        copy = outside / f"hard_{seed}_{path.name}"
        copy.write_bytes(data)
        os.link(copy, path)
    elif kind == "unreadable":
        path.write_bytes(data)
        path.chmod(0)
    elif kind == "sparse_4_gib":
        with open(path, "wb") as f:
            f.truncate(4 * 2**30)
    elif kind == "random_bytes":
        path.write_bytes(os.urandom(64 + seed % 4096))
    elif kind == "absolute_link_to_proc_self":
        path.symlink_to("/proc/self/environ")
    elif kind == "link_to_parent":
        path.symlink_to("..", target_is_directory=True)
    else:
        raise AssertionError(kind)


# ---- checkpoint trees ----------------------------------------------------------------------------
CKPT_NAMES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors",
              "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json", "vocab.json",
              "merges.txt", "tokenizer.model", "chat_template.jinja", "pytorch_model.bin",
              "model-00001-of-00002.safetensors", "training_info.json", "README.md", "sub/nested.json", ".cache"]


def _ckpt(root: Path) -> Path:
    ckpt = root / "ckpt" / "model"
    shutil.copytree(demo_model_dir(), ckpt)
    return ckpt


def _checkpoint_tree_examples(profile: Profile):
    @fuzz_settings(profile)
    @given(st.lists(st.tuples(st.sampled_from(CKPT_NAMES), st.sampled_from(KINDS)), min_size=1, max_size=3),
           st.integers(0, 2**16))
    def example(tmp: Path, changes, seed):
        root = _example_root(tmp)
        try:
            ckpt = _ckpt(root)
            originals = {p.name: p.read_bytes() for p in ckpt.iterdir()}
            for name, kind in changes:
                make_kind(ckpt / name, kind, root, originals.get(name, b"{}"), seed)
            before = _tree(root, skip=root / "out")
            answer = run_cli(["run", str(ckpt), "--output-dir", str(root / "out"), "--device", "cpu"], root,
                             stop_after=profile.stop_after)
            assert_documented_answer(answer, f"checkpoint files {changes}")
            assert _tree(root, skip=root / "out") == before, f"written outside the output folder: {changes}"
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_checkpoint_trees_with_links_and_special_files(profile, tmp_path):
    _checkpoint_tree_examples(profile)(tmp_path)


# ---- recipe trees and the state a recipe carries -------------------------------------------------
RECIPE_NAMES = ["infer.sh", "infer.py", "runner_r.py", "requirements.txt", "README.md", "config",
                "config/r_1card_eager.yaml", "config/other.yaml", "config/deep/x.yml", "models", "models/modeling_r.py",
                "models/__init__.py", "engine", "engine/safe_load.py", ".migrator", ".migrator/runs", ".migrator/backup",
                ".migrator/backup/round_1.journal", ".migrator/backup/round_1.manifest.json",
                ".migrator/backup/round_1", ".migrator/registry_edit.json", ".migrator/threads.json",
                ".migrator/checkpoints.sqlite", "migration_report.json", "baseline", "baseline/r_baseline.json", "res"]
CONTENT_KINDS = ["json_value", "yaml_doc"]
COMMANDS = [["run"], ["run", "--resume"], ["rollback"], ["baseline", "--summary", "{out}/summary"], ["rollback", "--round", "1"]]
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() |
                           st.text(max_size=8) | st.sampled_from(["../x", "/etc/passwd", "infer.sh", "file", "link", ".."]),
                           lambda kids: st.lists(kids, max_size=4) |
                           st.dictionaries(st.sampled_from(["path", "was", "mode", "target", "runs", "rounds", "registry",
                                                            "name", "offset", "inserted", "status", "model_name",
                                                            "transformers", "x"]), kids, max_size=5), max_leaves=20)


@pytest.fixture(scope="module")
def recipe_template(tmp_path_factory) -> Path:
    """A recipe of the demo model as `render` writes it (no trial run): copied by each example."""
    root = tmp_path_factory.mktemp("template")
    answer = run_cli(["run", str(demo_model_dir()), "--name", "r", "--output-dir", str(root / "out"), "--device", "cpu"],
                     root, stop_after="render", hang_s=0)
    assert answer.code == 0, answer.err[-2000:]
    return root / "out" / "r"


def _recipe_tree_examples(profile: Profile, template: Path):
    from fuzz_strategies import yaml_docs

    @fuzz_settings(profile)
    @given(st.lists(st.tuples(st.sampled_from(RECIPE_NAMES), st.sampled_from(KINDS + CONTENT_KINDS * 4)),
                    min_size=1, max_size=3),
           st.sampled_from(COMMANDS), st.integers(0, 2**16), st.data())
    def example(tmp: Path, changes, command, seed, data):
        root = _example_root(tmp)
        try:
            recipe = root / "recipe"
            shutil.copytree(template, recipe, symlinks=True)
            for name, kind in changes:
                path = recipe / name
                if kind in CONTENT_KINDS and not path.parent.is_dir():
                    continue
                if kind == "json_value":
                    make_kind(path, "empty_file", root, b"", seed)
                    path.write_text(json.dumps(data.draw(JSON_VALUES, label=name), default=str))
                elif kind == "yaml_doc":
                    make_kind(path, "empty_file", root, b"", seed)
                    path.write_text(data.draw(yaml_docs(), label=name))
                else:
                    with contextlib.suppress(OSError):        # its folder is no folder now: a combination skipped
                        make_kind(path, kind, root, path.read_bytes() if path.is_file() else b"x: 1\n", seed)
            before = _tree(root, skip=recipe)
            argv = [command[0], str(recipe), *[a.format(out=root / "out") for a in command[1:]]]
            answer = run_cli(argv, root, stop_after="detect_env")
            assert_documented_answer(answer, f"recipe {changes}, {argv[0]} {' '.join(argv[2:])}",
                                     runs_workflow=argv[0] != "rollback")
            after = {k: v for k, v in _tree(root, skip=recipe).items() if not k.startswith("out")}
            assert after == {k: v for k, v in before.items() if not k.startswith("out")}, \
                f"written outside the recipe: {changes} {argv}"
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_recipe_trees_and_their_state(profile, recipe_template, tmp_path):
    _recipe_tree_examples(profile, recipe_template)(tmp_path)


# ---- tokenizer files: what pre-flight accepts, the recipe's tokenizer loads ------------------------
TOKENIZER_PATHS = {
    "tokenizer.json": [("version",), ("truncation",), ("padding",), ("added_tokens",), ("added_tokens", 0),
                       ("added_tokens", 0, "content"), ("added_tokens", 0, "id"), ("added_tokens", 0, "special"),
                       ("normalizer",), ("pre_tokenizer",), ("pre_tokenizer", "type"), ("post_processor",),
                       ("post_processor", "type"), ("post_processor", "special_tokens"), ("decoder",),
                       ("decoder", "type"), ("model",), ("model", "type"), ("model", "vocab"), ("model", "merges"),
                       ("model", "unk_token"), ("model", "dropout"), ("model", "byte_fallback"), ("model", "merges", 0)],
    "tokenizer_config.json": [("bos_token",), ("eos_token",), ("pad_token",), ("unk_token",), ("model_max_length",),
                              ("tokenizer_class",), ("backend",), ("chat_template",), ("padding_side",),
                              ("added_tokens_decoder",), ("added_tokens_decoder", "0"), ("additional_special_tokens",),
                              ("clean_up_tokenization_spaces",), ("truncation_side",), ("model_input_names",)],
    "special_tokens_map.json": [("bos_token",), ("eos_token",), ("pad_token",), ("additional_special_tokens",),
                                ("eos_token", "content")],
    "added_tokens.json": [("<|new|>",), ("<|eos|>",)],
}
TOKEN_VALUES = st.one_of(JSON_VALUES, st.sampled_from(["<|eos|>", "<|bos|>", "", "BPE", "WordPiece", "Unigram",
                                                       "ByteLevel", "TemplateProcessing", "PreTrainedTokenizerFast",
                                                       "LlamaTokenizer", "NoSuchTokenizer", "left", "right", 10**9,
                                                       -1, 0.5, {"content": "<|eos|>"}, {"content": 5},
                                                       [["a", "b"]], ["a b"], {"type": "BPE"}, {"a": 0}]))


def _set_path(data, path: tuple, value, delete: bool):
    """`data` with the value at `path` set (or deleted); a path through something that is not a container
    makes the container there."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        if not isinstance(data, list):
            data = []
        if not data:
            data.append({})
        head = head % len(data)
        if delete and not rest:
            del data[head]
        else:
            data[head] = _set_path(data[head], rest, value, delete)
        return data
    if not isinstance(data, dict):
        data = {}
    if delete and not rest:
        data.pop(head, None)
    else:
        data[head] = _set_path(data.get(head), rest, value, delete)
    return data


def _tokenizer_examples(profile: Profile):
    from agent.errors import InputError
    from agent.migrate.checkpoint_check import check_tokenizer
    from engine.loading import load_tokenizer
    from engine.safe_load import LoadError

    @fuzz_settings(profile)
    @given(st.lists(st.tuples(st.sampled_from(sorted(TOKENIZER_PATHS)), st.integers(0, 100), TOKEN_VALUES,
                              st.booleans()), min_size=1, max_size=3))
    def example(tmp: Path, edits):
        root = _example_root(tmp)
        try:
            ckpt = _ckpt(root)
            for name, which, value, delete in edits:
                path = ckpt / name
                data = json.loads(path.read_text()) if path.is_file() else {}
                key = TOKENIZER_PATHS[name][which % len(TOKENIZER_PATHS[name])]
                path.write_text(json.dumps(_set_path(data, key, value, delete), default=str))
            try:
                check_tokenizer(ckpt)
            except (InputError, LoadError) as exc:
                assert "\n" not in str(exc) and str(ckpt) in str(exc), str(exc)
                return
            try:    # accepted by pre-flight: the recipe's own tokenizer loading must work on it
                tokenizer = load_tokenizer(str(ckpt))
                ids = tokenizer(["hello world", "a"], return_tensors="pt", padding=True, truncation=True)["input_ids"]
                tokenizer.decode(ids[0])
            except Exception as exc:  # noqa: BLE001 - any failure here is a finding: pre-flight let it through
                raise AssertionError(f"pre-flight accepted tokenizer files the recipe cannot load ({edits}): "
                                     f"{type(exc).__name__}: {exc}") from exc
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_tokenizer_files_preflight_accepts_only_what_loads(profile, tmp_path):
    _tokenizer_examples(profile)(tmp_path)


# ---- archives: --transformers-source wheels and folders -----------------------------------------
MEMBER_NAMES = ["transformers/__init__.py", "transformers/models/llama/modeling_llama.py", "transformers/utils.py",
                "transformers/a", "transformers/a/b.py", "transformers/../evil.py", "/transformers/abs.py",
                "transformers\\win.py", "transformers//double.py", "transformers/./dot.py", "transformers/",
                "transformers/sub/", "transformers/" + "x" * 300 + ".py", "transformers/ünï.py", "other/x.py",
                "transformers-5.3.1.dist-info/METADATA", "transformers/__init__.py/"]
INIT_TEXTS = [b'__version__ = "5.3.1"\n', b'__version__ = "5.0.0"\n', b'__version__ = "4.57.1"\n',
              b'__version__ = "99.0"\n', b'__version__ = "5.3.1.dev0"\n', b'__version__ = "five"\n', b"",
              b"\xff\xfe\x00\x00", b'__version__ = "' + b"5" * 5000 + b'"\n', b"raise SystemExit('ran')\n",
              b'__version__ = "5.3.1"\n' * 1000]
MEMBER_FLAWS = ["none", "symlink_mode", "fifo_mode", "corrupt_data", "encrypted_flag", "stored", "bzip2", "lzma",
                "claims_huge", "duplicate"]


def build_wheel(path: Path, members: list[tuple[str, bytes, str]]) -> None:
    """A zip of `members` (name, data, flaw): each flaw is one way a member's header or data lies."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data, flaw in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = {"stored": zipfile.ZIP_STORED, "bzip2": zipfile.ZIP_BZIP2,
                                  "lzma": zipfile.ZIP_LZMA}.get(flaw, zipfile.ZIP_DEFLATED)
            if flaw == "symlink_mode":
                info.external_attr = (0o120777 << 16)
            elif flaw == "fifo_mode":
                info.external_attr = (0o010644 << 16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)       # zipfile warns of the duplicate: the point
                archive.writestr(info, data)
                if flaw == "duplicate":
                    archive.writestr(zipfile.ZipInfo(name), data + b"# again\n")
    raw = bytearray(path.read_bytes())
    for name, data, flaw in members:            # flaws in the written bytes: the local header, the data
        at = raw.find(name.encode("utf-8", "surrogateescape"))
        if at < 0:
            continue
        if flaw == "corrupt_data" and len(raw) > at + len(name) + 4:
            for i in range(at + len(name), min(len(raw), at + len(name) + 12)):
                raw[i] ^= 0x5A
        elif flaw == "encrypted_flag":
            header = raw.rfind(b"PK\x03\x04", 0, at)
            if header >= 0:
                raw[header + 6] |= 0x01
        elif flaw == "claims_huge":
            header = raw.rfind(b"PK\x03\x04", 0, at)
            if header >= 0:
                raw[header + 22:header + 26] = (2**31).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


def _archive_examples(profile: Profile):
    @fuzz_settings(profile)
    @given(st.lists(st.tuples(st.sampled_from(MEMBER_NAMES), st.sampled_from(INIT_TEXTS), st.sampled_from(MEMBER_FLAWS)),
                    min_size=0, max_size=5),
           st.sampled_from(["wheel", "truncated_wheel", "folder", "folder_with_links"]))
    def example(tmp: Path, members, shape):
        root = _example_root(tmp)
        try:
            ckpt = _ckpt(root)
            source = root / "transformers-5.3.1-py3-none-any.whl"
            if shape in ("wheel", "truncated_wheel"):
                build_wheel(source, members)
                if shape == "truncated_wheel":
                    source.write_bytes(source.read_bytes()[: max(0, source.stat().st_size // 2)])
            else:
                source = root / "site-packages"
                for name, data, flaw in members:
                    target = source / name.lstrip("/")
                    with contextlib.suppress(OSError, ValueError):
                        if name.endswith("/"):
                            target.mkdir(parents=True, exist_ok=True)
                        elif shape == "folder_with_links" and flaw != "none":
                            target.parent.mkdir(parents=True, exist_ok=True)
                            make_kind(target, KINDS[hash(flaw) % len(KINDS)], root, data, 0)
                        else:
                            target.parent.mkdir(parents=True, exist_ok=True)
                            target.write_bytes(data)
                source.mkdir(exist_ok=True)
            registry = root / "checkout" / "executor" / "core" / "support_models.py"   # where a source applies
            registry.parent.mkdir(parents=True)
            registry.write_text("SUPPORTED_MODELS = {}\n")
            (root / "checkout" / "models").mkdir()
            before = _tree(root, skip=root / "out")
            answer = run_cli(["run", str(ckpt), "--output-dir", str(root / "checkout" / "models"), "--device", "cpu",
                              "--transformers-source", str(source)], root, stop_after=profile.stop_after)
            assert_documented_answer(answer, f"--transformers-source {shape} {members}")
            assert _tree(root, skip=root / "out") == before, f"written outside the output folder: {members}"
            if answer.code == 10:       # the source refused: nothing of it left in the cache
                cache = root / "out" / "xdg" / "infer-migrator" / "transformers" / "unpacked"
                assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_transformers_source_archives(profile, tmp_path):
    _archive_examples(profile)(tmp_path)


# ---- environment variables the tool reads ---------------------------------------------------------
ENV_NAMES = ["HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "MODELSCOPE_CACHE",
             "MODELSCOPE_DOMAIN", "MODELSCOPE_ENDPOINT", "XDG_CACHE_HOME", "MIGRATOR_DEVICE_MEMORY_BYTES",
             "MIGRATOR_IMPORT_TIMEOUT_S", "MIGRATOR_LLM_BASE_URL", "MIGRATOR_LLM_TIMEOUT_S", "MIGRATOR_LLM_MODEL",
             "MIGRATOR_LLM_API_KEY", "MIGRATOR_LLM_APPLY", "MIGRATOR_PARITY_DUMP", "MIGRATOR_PRECISION_RECORD",
             "MIGRATOR_NO_CODEMOD_CACHE", "MIGRATOR_TORCH_NPU_IMPORTS", "MIGRATOR_OUTER_TMPDIR"]
ENV_VALUES = ["", "0", "1", "-1", "abc", "1e309", "nan", "99999999999999999999", "8G", "/dev/null", "/nonexistent/x",
              "relative/dir", "{root}/outside/secret.txt", "{root}/outside", "http://", "ftp://x", "http://[::1",
              "https://huggingface.co/../../x", "\t", "x" * 5000, "true", "é", "{root}/outside/../../.."]
ENV_COMMANDS = [["run", "{ckpt}", "--output-dir", "{root}/out", "--device", "cpu"], ["env"], ["env", "--json"],
                ["run", "Org/Model", "--output-dir", "{root}/out", "--device", "cpu"],
                ["run", "https://modelscope.cn/models/Org/Model", "--output-dir", "{root}/out", "--device", "cpu"]]


def _environment_examples(profile: Profile):
    @fuzz_settings(profile)
    @given(st.dictionaries(st.sampled_from(ENV_NAMES), st.sampled_from(ENV_VALUES), min_size=1, max_size=4),
           st.sampled_from(ENV_COMMANDS))
    def example(tmp: Path, values, command):
        root = _example_root(tmp)
        try:
            ckpt = _ckpt(root)
            env = {k: v.format(root=root) for k, v in values.items()}
            argv = [a.format(root=root, ckpt=ckpt) for a in command]
            before = _tree(root, skip=root / "out")
            answer = run_cli(argv, root, env=env, stop_after=profile.stop_after)
            assert_documented_answer(answer, f"environment {values}, {' '.join(command)}",
                                     runs_workflow=command[0] == "run")
            assert _tree(root, skip=root / "out") == before, f"written outside the output folder: {values}"
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_environment_variables(profile, tmp_path):
    _environment_examples(profile)(tmp_path)


# ---- hub references through the CLI (tests/unit/agent/migrate/test_hub_refs.py fuzzes the parser; here repo ids as well) ----
def _hub_examples(profile: Profile):
    from fuzz_strategies import PIECES

    @fuzz_settings(profile)
    @given(st.lists(PIECES, min_size=1, max_size=4), st.lists(PIECES, min_size=1, max_size=4),
           st.lists(PIECES, min_size=0, max_size=4),
           st.sampled_from(["hf_link", "hf_tree", "hf_uri", "repo_id", "ms_link", "ms_query", "ms_hub_repo_id"]))
    def example(tmp: Path, org, name, revision, form):
        root = _example_root(tmp)
        try:
            org_, name_, rev = "".join(org), "".join(name), "".join(revision)
            target = {"hf_link": f"https://huggingface.co/{org_}/{name_}",
                      "hf_tree": f"https://huggingface.co/{org_}/{name_}/tree/{rev}",
                      "hf_uri": f"hf://{org_}/{name_}@{rev}", "repo_id": f"{org_}/{name_}",
                      "ms_link": f"https://modelscope.cn/models/{org_}/{name_}",
                      "ms_query": f"https://modelscope.cn/models/{org_}/{name_}?revision={rev}",
                      "ms_hub_repo_id": f"{org_}/{name_}"}[form]
            argv = ["run", target, "--output-dir", str(root / "out"), "--device", "cpu"]
            if form == "ms_hub_repo_id":
                argv += ["--hub", "modelscope"]
            before = _tree(root, skip=root / "out")
            answer = run_cli(argv, root, stop_after=profile.stop_after)
            assert_documented_answer(answer, f"hub reference {target!r}")
            # offline, with empty caches: nothing is found, so every reference is refused (no local folder taken)
            assert answer.code in (2, 3, 4), f"{target!r}: exit {answer.code}"
            assert _tree(root, skip=root / "out") == before, f"written outside the output folder: {target!r}"
        finally:
            _cleanup(root)
    return example


@pytest.mark.parametrize("profile", FUZZ_PROFILES)
def test_fuzz_hub_references_through_the_cli(profile, tmp_path):
    _hub_examples(profile)(tmp_path)


# ---- signals at every node of the LangGraph run (scripts/signal_matrix.py, one pair per case) --------
HAPPY_PATH = ["detect_env", "classify", "acquire", "vendor", "decide_native", "render", "trial_run", "collect_baseline", "verify",
              "report"]


@pytest.mark.slow      # a real `migrator run` subprocess and its --resume per pair: minutes each
@pytest.mark.parametrize("sig", ["INT", "TERM", "KILL"])
@pytest.mark.parametrize("node", HAPPY_PATH)
def test_a_signal_at_every_node_stops_the_tree_and_resume_finishes(sig, node, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("signal_matrix", REPO_ROOT / "scripts" /
                                                  "signal_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    row = matrix.one(sig, node, tmp_path)
    assert not row["traceback"], row
    if row["exit"] != 0:            # a node faster than the signal: the run had finished
        assert row["exit"] == {"INT": 130, "TERM": 143, "KILL": -9}[sig], row
        if sig != "KILL":
            assert row["left"] == 0, row                 # the whole tree stopped with the migrator
            assert "--resume" in row["line"], row        # the one line names how to continue
    assert row["resume_exit"] == 0, row
