"""Bad input, one table (SPEC §6): every row is a hostile or broken input given to `migrator` as a user
would give it. Each row asserts the documented exit code, exactly one `migrator: error:` line on
stderr and no traceback, nothing written outside --output-dir (the checkpoint included), no code
from the input run, and no half-built recipe left to block a re-run.

The CLI runs in-process (agent.cli.main) so the table stays fast; no row reaches a trial run.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from agent import errors
from agent.cli import main
from agent.paths import demo_model_dir

MARKER = "PWNED"   # hostile inputs try to create this file; it must never appear


@dataclass
class Case:
    id: str
    setup: Callable[[Path, Path], list[str]]   # (tmp, checkpoint copy) -> argv
    code: int
    says: str                                  # a fragment the error line must contain
    env: dict | None = None                    # environment variables set for the row
    known: str | None = None                   # an open issue the row fails on until it lands (xfail, strict)


def _cfg(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def config(**changes):
    """Setup: run the checkpoint after changing (None = deleting) config.json fields."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        data = _cfg(ckpt)
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (ckpt / "config.json").write_text(json.dumps(data))
        return ["run", str(ckpt)]
    return setup


def config_bytes(raw: bytes):
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        (ckpt / "config.json").write_bytes(raw)
        return ["run", str(ckpt)]
    return setup


def file_bytes(name: str, raw: bytes | None):
    """Setup: replace (None = delete) one file of the checkpoint."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        path = ckpt / name
        if raw is None:
            path.unlink()
        else:
            path.write_bytes(raw)
        return ["run", str(ckpt)]
    return setup


def truncate_weights(tmp: Path, ckpt: Path) -> list[str]:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return ["run", str(ckpt)]


def weights_header_too_long(tmp: Path, ckpt: Path) -> list[str]:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    return ["run", str(ckpt)]


def missing_shard(tmp: Path, ckpt: Path) -> list[str]:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 1}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return ["run", str(ckpt)]


def json_file(name: str, **changes):
    """Setup: change (None = delete) fields of one JSON file of the checkpoint."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        path = ckpt / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        path.write_text(json.dumps(data))
        return ["run", str(ckpt)]
    return setup


def tokenizer_json(**changes):
    """Setup: tokenizer.json with top-level fields set (None is JSON null, not a deletion)."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        path = ckpt / "tokenizer.json"
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
        return ["run", str(ckpt)]
    return setup


def special_file(name: str, kind: str):
    """Setup: one file of the checkpoint replaced by a symlink loop, a dangling symlink, a FIFO or a link to
    /dev/zero."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        path = ckpt / name
        if path.exists():
            path.unlink()
        if kind == "loop":
            path.symlink_to(path.name)
        elif kind == "dangling":
            path.symlink_to(tmp / "moved away" / name)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        return ["run", str(ckpt)]
    return setup


def args(*argv: str):
    """Setup: the checkpoint with extra options (`{ckpt}` / `{tmp}` are filled in)."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        return [a.format(ckpt=ckpt, tmp=tmp) for a in argv]
    return setup


def renamed_checkpoint(new_name: str):
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        target = ckpt.with_name(new_name)
        ckpt.rename(target)
        return ["run", str(target)]
    return setup


def output_dir_is_file(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["run", str(ckpt), "--output-dir", str(tmp / "afile")]


def output_dir_under_file(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["run", str(ckpt), "--output-dir", str(tmp / "afile" / "sub")]


def recipe_exists(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "out" / "my_model").mkdir(parents=True)
    (tmp / "out" / "my_model" / "keep.txt").write_text("user's file")
    return ["run", str(ckpt), "--name", "my_model"]


def recipe_folder_is(make: Callable[[Path, Path], None]):
    """Setup: the recipe's folder under --output-dir (out/my_model) already is something `make(path, tmp)` put there."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        (tmp / "out").mkdir()
        (tmp / "elsewhere" / "empty").mkdir(parents=True)
        make(tmp / "out" / "my_model", tmp)
        return ["run", str(ckpt), "--name", "my_model"]
    return setup


def mistyped_local_path(tmp: Path, ckpt: Path) -> list[str]:
    return ["run", "ckpt/nonexist"]


def remote_code(auto_map: dict, files: dict[str, str] | None = None, trust: bool = True, link: str | None = None):
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        data = _cfg(ckpt)
        data["auto_map"] = auto_map
        (ckpt / "config.json").write_text(json.dumps(data))
        for name, text in (files or {}).items():
            (ckpt / name).write_text(text)
        if link:
            outside = tmp / "outside_settings.py"
            outside.write_text("SECRET = 1\n")
            (ckpt / link).symlink_to(outside)
        return ["run", str(ckpt)] + (["--trust-remote-code"] if trust else [])
    return setup


def recipe_yaml(raw: bytes, name: str = "r_1card_eager.yaml", *extra: str):
    """Setup: a recipe folder (infer.sh, config/NAME) whose YAML is `raw`; `migrator run RECIPE [extra]`."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        recipe = tmp / "recipe"
        (recipe / "config").mkdir(parents=True)
        (recipe / "infer.sh").write_text("#!/bin/bash\necho never run > PWNED\n")
        (recipe / "config" / name).parent.mkdir(parents=True, exist_ok=True)
        (recipe / "config" / name).write_bytes(raw)
        return ["run", str(recipe), *extra]
    return setup


def as_baseline(setup):
    """Setup: the same input given to `migrator baseline` (its table under the output dir)."""
    def wrapped(tmp: Path, ckpt: Path) -> list[str]:
        argv = setup(tmp, ckpt)
        return ["baseline", *[a for a in argv[1:] if a != "--standin"], "--summary", str(tmp / "out" / "summary")]
    return wrapped


def recipe_entry_loop(tmp: Path, ckpt: Path) -> list[str]:
    """Setup: a recipe whose infer.py is a two-link symlink loop."""
    argv = recipe_yaml(b"model_name: r\n")(tmp, ckpt)
    (tmp / "recipe" / "infer.py").symlink_to("infer2.py")
    (tmp / "recipe" / "infer2.py").symlink_to("infer.py")
    return argv


def rendered_recipe_with_link(rel: str):
    """Setup: a recipe of the demo model as `render` writes it, `rel` symlinked to a folder outside it;
    `migrator run RECIPE` (a trial run: what it writes must not go through the link)."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        from agent.workflow.run import run_migration

        run_migration({"target": str(ckpt), "output_dir": str(tmp / "out"), "name": "r", "device": "cpu",
                       "max_new_tokens": 4}, stop_after="render")
        recipe = tmp / "out" / "r"                  # a recipe is written in place: inside the output dir
        (tmp / "shared").mkdir()
        (recipe / rel).parent.mkdir(parents=True, exist_ok=True)
        (recipe / rel).symlink_to(tmp / "shared", target_is_directory=True)
        return ["run", str(recipe)]
    return setup


def alias_bomb(levels: int, width: int) -> bytes:
    lines = ["model_name: r", "model_path: ../ckpt", "model_config:", "  config_overrides:",
             f"    l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def wheel_of_zeros(member: str, size: int, version: str = "5.3.1"):
    """Setup: --transformers-source a small wheel one of whose members inflates to `size` zero bytes."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        import zipfile

        wheel = tmp / f"transformers-{version[:20]}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            if member != "transformers/__init__.py":
                archive.writestr("transformers/__init__.py", f'__version__ = "{version}"\n')
            info = zipfile.ZipInfo(member)
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w") as sink:
                for _ in range(size // 2**22):
                    sink.write(bytes(2**22))
        return ["run", str(ckpt), "--transformers-source", str(wheel), "--output-dir", str(checkout_models(tmp))]
    return setup


def checkout_models(tmp: Path) -> Path:
    """A checkout's models/ folder (executor/core/support_models.py above it): where --transformers-source applies."""
    registry = tmp / "checkout" / "executor" / "core" / "support_models.py"
    registry.parent.mkdir(parents=True, exist_ok=True)
    registry.write_text("SUPPORTED_MODELS = {}\n")
    (tmp / "checkout" / "models").mkdir(exist_ok=True)
    return tmp / "checkout" / "models"


def forged_state(journal: list | None = None, manifest: list | None = None, record: dict | None = None,
                 saved: dict[str, bytes] | None = None):
    """Setup: a received recipe whose .migrator state (round 1's journal or manifest, its saved copies, a
    registry record) is forged; `migrator rollback RECIPE`. Entries may name `{tmp}`."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        recipe = tmp / "recipe"
        backups = recipe / ".migrator" / "backup"
        (backups / "round_1").mkdir(parents=True)
        (recipe / "infer.sh").write_text("#!/bin/bash\necho ok\n")
        for rel, data in (saved or {"infer.sh": b"#!/bin/bash\necho saved\n"}).items():
            (backups / "round_1" / rel).parent.mkdir(parents=True, exist_ok=True)
            (backups / "round_1" / rel).write_bytes(data)
        fill = lambda v: json.loads(json.dumps(v).replace("{tmp}", str(tmp)))   # noqa: E731
        if journal is not None:
            (backups / "round_1.journal").write_text("".join(json.dumps(fill(e)) + "\n" for e in journal))
        if manifest is not None:
            (backups / "round_1.manifest.json").write_text(json.dumps(fill(manifest)))
        if record is not None:
            (tmp / "victim.py").write_text("keep = 1\nINSERTED = 2\n")
            text = record.format(tmp=tmp) if isinstance(record, str) else json.dumps(fill(record))   # str: raw text
            (recipe / ".migrator" / "registry_edit.json").write_text(text)
            shutil.rmtree(backups)
        return ["rollback", str(recipe)]
    return setup


_HELD_ELSEWHERE: list[int] = []     # lock fds a row holds "as another command"; closed after the row


def recipe_locked(command: str, *extra: str):
    """Setup: a legacy recipe whose folder lock another command holds (agent.folder_lock: an flock
    on a second open file description is another holder, as another process would be); `migrator COMMAND`."""
    def setup(tmp: Path, ckpt: Path) -> list[str]:
        import fcntl
        import hashlib

        from agent import folder_lock

        recipe = tmp / "recipe"
        (recipe / "config").mkdir(parents=True)
        (recipe / "infer.sh").write_text("#!/bin/bash\necho never run > PWNED\n")
        (recipe / "config" / "r.yaml").write_text("model_name: r\n")
        root = folder_lock.lock_dirs()[0]
        root.mkdir(parents=True, exist_ok=True)
        key = str(recipe.resolve())
        fd = os.open(root / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, b"pid 4242: migrator run other")
        _HELD_ELSEWHERE.append(fd)
        return [a.format(tmp=tmp) for a in (command, str(recipe), *extra)]
    return setup


HOSTILE_ARCH = 'X"""\nimport os; os.system("touch PWNED")\n"""'
REMOTE_OK = {"AutoConfig": "configuration_custom.CustomConfig",
             "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
REMOTE_FILES = {"configuration_custom.py": "from .model_setting import X\nclass CustomConfig: pass\n",
                "modeling_custom.py": "from .model_setting import X\nclass CustomForCausalLM: pass\n",
                "model_setting.py": "X = 1\n"}

CASES = [
    # names
    Case("name_not_ascii", args("run", "{ckpt}", "--name", "模型"), 2, "ASCII letters"),
    Case("name_300_chars", args("run", "{ckpt}", "--name", "a" * 300), 2, "at most 64"),
    Case("name_only_symbols", args("run", "{ckpt}", "--name=..."), 2, "ASCII letters"),
    Case("name_with_newline", args("run", "{ckpt}", "--name", "a\nb"), 2, "control characters"),
    # paths
    Case("path_with_newline", renamed_checkpoint("ck\npt"), 2, "control characters"),
    Case("path_is_a_file", args("run", "{ckpt}/config.json"), 2, "not a directory"),
    Case("path_empty_dir", args("run", "{tmp}"), 2, "no config.json"),
    Case("mistyped_local_path", mistyped_local_path, 2, "no such directory"),
    Case("link_other_host", args("run", "https://example.com/Org/Model"), 2, "not a Hugging Face"),
    Case("link_dataset", args("run", "https://huggingface.co/datasets/Org/Data"), 2, "dataset"),
    Case("link_no_repo", args("run", "https://huggingface.co/"), 2, "not a Hugging Face"),
    Case("modelscope_dataset_link", args("run", "https://modelscope.cn/datasets/Org/Data"), 2, "not a model"),
    Case("modelscope_bad_id", args("run", "--hub", "modelscope", "Org/Na me"), 2, "not a ModelScope model id"),
    Case("modelscope_link_with_hub_hf", args("run", "--hub", "hf", "https://modelscope.cn/models/Org/M"), 2, "--hub hf"),
    Case("hf_link_with_hub_modelscope", args("run", "--hub", "modelscope", "https://huggingface.co/Org/M"), 2,
         "not a ModelScope link"),
    Case("modelscope_not_cached_offline", args("run", "https://modelscope.cn/models/Org/Absent"), 2,
         "not in the local ModelScope cache"),
    # hub references: revision / repo id decoded (repeatedly) and checked before any cache lookup (hub_refs)
    Case("hf_revision_encoded_dotdot", args("run", "https://huggingface.co/Org/Model/tree/..%2F..%2F..%2F..%2Fckpt%2Fmodel"),
         2, "contains '..'"),
    Case("hf_revision_double_encoded_dotdot", args("run", "https://huggingface.co/Org/Model/tree/..%252F..%252Fckpt"),
         2, "contains '..'"),
    Case("hf_revision_absolute_path", args("run", "https://hf.co/Org/Model/tree/%2Fetc"), 2, "absolute path"),
    Case("hf_uri_revision_control_char", args("run", "hf://Org/Model@main%0Ax"), 2, "control"),
    Case("hf_revision_backslash", args("run", "https://huggingface.co/Org/Model/tree/..%5C..%5Cx"), 2, "backslash"),
    Case("modelscope_query_revision_dotdot", args("run", "https://modelscope.cn/models/Org/Model?revision=../../../ckpt/model"),
         2, "contains '..'"),
    Case("modelscope_query_revision_absolute", args("run", "https://modelscope.cn/models/Org/Model?revision={ckpt}"),
         2, "absolute path"),
    Case("modelscope_tree_revision_triple_encoded", args("run", "https://www.modelscope.cn/models/Org/Model/tree/"
                                                                "..%25252F..%25252Fckpt"), 2, "contains '..'"),
    Case("modelscope_revision_git_forbidden", args("run", "https://modelscope.cn/models/Org/Model/tree/v1~2"), 2,
         "does not allow"),
    Case("modelscope_revision_lock", args("run", "--hub", "modelscope",
                                          "https://modelscope.ai/models/Org/Model?revision=x.lock"), 2,
         "component ending with '.lock'"),
    # options
    Case("max_rounds_huge", args("run", "{ckpt}", "--max-rounds", "99999999999999999999"), 2, "out of range"),
    Case("max_rounds_negative", args("run", "{ckpt}", "--max-rounds", "-1"), 2, "out of range"),
    Case("max_rounds_not_int", args("run", "{ckpt}", "--max-rounds", "five"), 2, "not an integer"),
    Case("timeout_zero", args("run", "{ckpt}", "--timeout", "0"), 2, "out of range"),
    Case("max_new_tokens_zero", args("run", "{ckpt}", "--max-new-tokens", "0"), 2, "out of range"),
    Case("dtype_unknown", args("run", "{ckpt}", "--dtype", "float8"), 2, "invalid choice"),
    Case("unknown_option", args("run", "{ckpt}", "--frobnicate"), 2, "unrecognized arguments"),
    Case("output_dir_is_file", output_dir_is_file, 2, "not a directory"),
    Case("output_dir_under_a_file", output_dir_under_file, 2, "cannot be created"),
    Case("output_dir_inside_checkpoint", args("run", "{ckpt}", "--output-dir", "{ckpt}/recipes"), 2,
         "inside the checkpoint"),
    Case("recipe_dir_exists", recipe_exists, 2, "already exists"),
    # found checking #31.1 by variants: the recipe's own folder, a link out of --output-dir, was migrated into
    # (an empty folder elsewhere: exit 0, the recipe written there) or crashed (exit 70)
    Case("recipe_dir_linked_to_an_empty_folder_elsewhere", recipe_folder_is(
        lambda p, tmp: p.symlink_to(tmp / "elsewhere" / "empty", target_is_directory=True)), 2,
         "my_model is a symlink to"),
    Case("recipe_dir_relative_link_up_and_out", recipe_folder_is(
        lambda p, tmp: p.symlink_to("../elsewhere/empty", target_is_directory=True)), 2, "outside the output folder"),
    Case("recipe_dir_dangling_link_out", recipe_folder_is(
        lambda p, tmp: p.symlink_to(tmp / "elsewhere" / "not_yet", target_is_directory=True)), 2,
         "outside the output folder"),
    Case("recipe_dir_dangling_link_inside", recipe_folder_is(lambda p, tmp: p.symlink_to("nothing")), 2,
         "exists and is not a folder"),
    Case("recipe_dir_a_fifo", recipe_folder_is(lambda p, tmp: os.mkfifo(p)), 2, "exists and is not a folder"),
    # found by tests/e2e/test_fuzz_inputs.py: a relative XDG_CACHE_HOME put the folder locks (and caches) under the
    # working directory; the XDG spec says to ignore it (agent.paths.cache_home)
    Case("xdg_cache_home_relative", recipe_exists, 2, "already exists", env={"XDG_CACHE_HOME": "nan"}),
    # found by tests/e2e/test_fuzz_inputs.py: MODELSCOPE_ENDPOINT='http://[::1' was a ValueError of urlsplit (exit 70);
    # every URL-valued variable is checked once at the start of the commands that read it (inputs.check_environment)
    *[Case(f"url_variable_{name.lower()}_{kind}", args("run", "Org/Model"), 2, name, env={name: value})
      for name in ("HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "MODELSCOPE_DOMAIN", "MIGRATOR_LLM_BASE_URL")
      for kind, value in (("bad_ipv6", "http://[::1"), ("port_out_of_range", "https://mirror.example:70000"),
                          ("port_not_a_number", "http://h:p/"), ("scheme_ftp", "ftp://mirror.example"),
                          ("no_host", "https://"), ("space", "https://a b.example"))],
    Case("weights_option_missing", args("run", "Org/Model", "--weights", "{tmp}/nope"), 2, "--weights"),
    Case("device_npu_without_npu", args("run", "{ckpt}", "--device", "npu"), 4, "npu"),
    # config.json: not an object, not JSON, wrong encoding
    Case("config_array", config_bytes(b"[1, 2]"), 2, "JSON array"),
    Case("config_string", config_bytes(b'"LlamaForCausalLM"'), 2, "JSON string"),
    Case("config_null", config_bytes(b"null"), 2, "JSON null"),
    Case("config_empty", config_bytes(b""), 2, "empty"),
    Case("config_truncated_json", config_bytes(b'{"model_type": "llama", '), 2, "not valid JSON"),
    Case("config_utf8_bom", lambda tmp, ckpt: config_bytes(b"\xef\xbb\xbf" + (ckpt / "config.json").read_bytes())(tmp, ckpt),
         2, "byte-order mark"),
    Case("config_not_utf8", config_bytes(b'{"model_type": "llama\xff\xfe"}'), 2, "not UTF-8"),
    Case("config_nan", config_bytes(b'{"model_type": "llama", "rms_norm_eps": NaN}'), 2, "not a JSON number"),
    Case("config_deeply_nested", config_bytes(b"[" * 100000 + b"]" * 100000), 2, "JSON"),
    # config.json: fields of the wrong type or out of range
    Case("architectures_int", config(architectures=[5]), 2, "not a Python class name"),
    Case("architectures_code_injection", config(architectures=[HOSTILE_ARCH]), 2, "not a Python class name"),
    Case("architectures_string", config(architectures="LlamaForCausalLM"), 2, "non-empty list"),
    Case("architectures_empty", config(architectures=[]), 2, "non-empty list"),
    Case("model_type_missing", config(model_type=None), 2, "model_type"),
    Case("model_type_shell", config(model_type="llama; touch PWNED"), 2, "model_type"),
    Case("model_type_unknown", config(model_type="not_a_real_type"), 3, "unknown to transformers"),
    Case("max_position_embeddings_string", config(max_position_embeddings="512"), 2, "must be an integer"),
    Case("hidden_size_negative", config(hidden_size=-128), 2, "out of range"),
    Case("num_hidden_layers_zero", config(num_hidden_layers=0), 2, "out of range"),
    Case("hidden_size_huge", config(hidden_size=10**30), 2, "out of range"),
    Case("vocab_size_float", config(vocab_size=768.0), 2, "must be an integer"),
    Case("vocab_size_bool", config(vocab_size=True), 2, "must be an integer"),
    Case("eos_token_negative", config(eos_token_id=-5), 2, "token id"),
    Case("tie_word_embeddings_string", config(tie_word_embeddings="yes"), 2, "true or false"),
    Case("rms_norm_eps_string", config(rms_norm_eps="1e-5"), 2, "number"),
    Case("rope_parameters_list", config(rope_parameters=[1, 2]), 2, "JSON object"),
    # a quantization_config over weights that are not quantized so: the config is not these weights'
    Case("quantized_config_over_plain_weights", config(quantization_config={"quant_method": "gptq"}), 2,
         "says the weights are GPTQ (quant_method gptq), but no tensor is"),
    Case("quantized_by_an_unread_method", config(quantization_config={"quant_method": "hqq"}), 3,
         "weights are quantized: quant_method hqq, which the migrator neither serves nor converts"),
    Case("quantized_by_a_method_that_is_no_name", config(quantization_config={"quant_method": "$(touch PWNED)"}), 3,
         "a quant_method this line does not show"),
    Case("quantized_fp8_blocks_of_zero", config(quantization_config={"quant_method": "fp8",
                                                                     "weight_block_size": [0, 128]}), 2,
         "weight_block_size must be two positive integers"),
    Case("quantized_compressed_tensors_without_groups", config(quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized"}), 2, "has no config_groups"),
    Case("encoder_decoder", config(is_encoder_decoder=True), 3, "encoder-decoder"),
    Case("encoder_only_bert", config(model_type="bert", architectures=["BertForMaskedLM"]), 3, "encoder"),
    # weights do not match the config
    Case("config_of_another_vocab", config(vocab_size=1000), 2, "vocab_size"),
    Case("config_with_more_layers", config(num_hidden_layers=8), 2, "num_hidden_layers"),
    # weights that do not match the config in a size, or a count the files cannot hold
    Case("num_hidden_layers_million", config(num_hidden_layers=1000000), 2, "num_hidden_layers 1000000"),
    Case("hidden_size_of_another_model", config(hidden_size=256, head_dim=64), 2, "hidden_size 256"),
    Case("intermediate_size_of_another_model", config(intermediate_size=384 * 64), 2, "intermediate_size 24576"),
    # config fields transformers itself rejects or cannot build
    Case("hidden_act_number", config(hidden_act=5), 2, "hidden_act"),
    Case("attention_bias_string", config(attention_bias="yes"), 2, "attention_bias"),
    Case("heads_do_not_divide_hidden", config(num_attention_heads=3), 2, "multiple of the number of attention heads"),
    Case("hidden_act_unknown", config(hidden_act="not_an_activation"), 2, "cannot be built"),
    # files that are not files
    Case("config_symlink_loop", special_file("config.json", "loop"), 2, "symlink loop"),
    Case("config_fifo", special_file("config.json", "fifo"), 2, "FIFO"),
    Case("config_dev_zero", special_file("config.json", "dev_zero"), 2, "character device"),
    Case("weights_symlink_loop", special_file("loop.safetensors", "loop"), 2, "symlink loop"),
    Case("tokenizer_json_dev_zero", special_file("tokenizer.json", "dev_zero"), 2, "character device"),
    Case("tokenizer_config_fifo", special_file("tokenizer_config.json", "fifo"), 2, "FIFO"),
    # found by tests/e2e/test_fuzz_inputs.py: a dangling link was a FileNotFoundError traceback (exit 70), not bad input
    Case("added_tokens_dangling_symlink", special_file("added_tokens.json", "dangling"), 2, "dangling link"),
    Case("config_dangling_symlink", special_file("config.json", "dangling"), 2, "dangling link"),
    Case("weights_dangling_symlink", special_file("model.safetensors", "dangling"), 2, "dangling link"),
    Case("tokenizer_json_dangling_symlink", special_file("tokenizer.json", "dangling"), 2, "dangling link"),
    # tokenizer_config.json / generation_config.json fields of the wrong kind
    Case("tokenizer_eos_token_number", json_file("tokenizer_config.json", eos_token=5), 2, "eos_token"),
    Case("tokenizer_model_max_length_string", json_file("tokenizer_config.json", model_max_length="long"), 2,
         "model_max_length"),
    Case("tokenizer_padding_side_unknown", json_file("tokenizer_config.json", padding_side="middle"), 2,
         "padding_side"),
    Case("tokenizer_chat_template_number", json_file("tokenizer_config.json", chat_template=5), 2, "chat_template"),
    Case("generation_eos_token_id_string", json_file("generation_config.json", eos_token_id="2"), 2,
         "generation_config.json: 'eos_token_id'"),
    Case("generation_do_sample_string", json_file("generation_config.json", do_sample="yes"), 2, "do_sample"),
    Case("generation_config_array", file_bytes("generation_config.json", b"[1]"), 2, "generation_config.json"),
    # tokenizer
    Case("tokenizer_missing", lambda tmp, ckpt: [(ckpt / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")]
         and ["run", str(ckpt)], 2, "no tokenizer"),
    Case("tokenizer_json_empty", file_bytes("tokenizer.json", b""), 2, "empty"),
    Case("tokenizer_config_broken", file_bytes("tokenizer_config.json", b"{"), 2, "not valid JSON"),
    # tokenizer files the recipe's tokenizer reads: checked in pre-flight, before anything is written
    Case("special_tokens_map_list", file_bytes("special_tokens_map.json", b'["<s>", "</s>"]'), 2,
         "special_tokens_map.json: must be a JSON object, got a JSON array"),
    Case("special_tokens_map_string", file_bytes("special_tokens_map.json", b'"<s>"'), 2, "special_tokens_map.json"),
    Case("special_tokens_map_token_number", file_bytes("special_tokens_map.json", b'{"eos_token": 5}'), 2,
         "'eos_token' must be a token"),
    Case("special_tokens_map_additional_nested", file_bytes("special_tokens_map.json",
                                                            b'{"additional_special_tokens": [["<a>"]]}'), 2,
         "additional_special_tokens"),
    Case("tokenizer_json_model_null", tokenizer_json(model=None), 2, "tokenizer.json: 'model' must be a JSON object"),
    Case("tokenizer_json_model_list", tokenizer_json(model=["BPE"]), 2, "'model' must be a JSON object"),
    Case("tokenizer_json_model_empty", tokenizer_json(model={}), 2, "neither a 'type' nor a 'vocab'"),
    Case("tokenizer_json_added_tokens_strings", tokenizer_json(added_tokens=["<s>"]), 2, "added_tokens"),
    Case("tokenizer_json_decoder_string", tokenizer_json(decoder="ByteLevel"), 2, "'decoder' must be"),
    # found by tests/e2e/test_fuzz_inputs.py: the rest of tokenizer.json's schema is the tokenizers library's own
    Case("tokenizer_json_version_null", tokenizer_json(version=None), 2, "tokenizers library cannot build"),
    Case("tokenizer_json_pre_tokenizer_unknown", tokenizer_json(pre_tokenizer={"type": "NoSuchSplit"}), 2,
         "tokenizers library cannot build"),
    Case("tokenizer_json_truncation_max_length_string", tokenizer_json(truncation={"max_length": "512"}), 2,
         "tokenizers library cannot build"),
    Case("tokenizer_json_merge_of_three_words", lambda tmp, ckpt: tokenizer_json(model=dict(
        json.loads((ckpt / "tokenizer.json").read_text())["model"], merges=["a b c"]))(tmp, ckpt), 2,
         "tokenizers library cannot build"),
    Case("tokenizer_json_without_added_tokens", lambda tmp, ckpt: file_bytes("tokenizer.json", json.dumps(
        {k: v for k, v in json.loads((ckpt / "tokenizer.json").read_text()).items() if k != "added_tokens"}).encode())(
        tmp, ckpt), 2, "transformers cannot build the tokenizer"),
    Case("tokenizer_config_added_tokens_decoder_bad_id", json_file("tokenizer_config.json", added_tokens_decoder={
        "x": {"content": "<|eos|>"}}), 2, "tokenizer"),
    Case("tokenizer_json_missing_config_needs_it", file_bytes("tokenizer.json", None), 2,
         "tokenizer.json: missing, and nothing else here holds the vocabulary"),
    Case("added_tokens_json_list", file_bytes("added_tokens.json", b"[1]"), 2, "added_tokens.json: must be a JSON object"),
    # found by tests/e2e/test_fuzz_inputs.py: ids of another kind passed pre-flight, then broke the recipe's tokenizer
    Case("added_tokens_json_id_null", file_bytes("added_tokens.json", b'{"<|new|>": null}'), 2,
         "'<|new|>' must be a non-negative integer"),
    Case("added_tokens_json_id_string", file_bytes("added_tokens.json", b'{"<|new|>": "7"}'), 2, "non-negative integer"),
    Case("added_tokens_json_id_negative", file_bytes("added_tokens.json", b'{"<|new|>": -3}'), 2, "non-negative integer"),
    Case("vocab_json_id_float", file_bytes("vocab.json", b'{"a": 1.5}'), 2, "vocab.json: the id of 'a'"),
    # weights
    Case("weights_missing", file_bytes("model.safetensors", None), 2, "no weight files"),
    Case("weights_empty", file_bytes("model.safetensors", b""), 2, "empty"),
    Case("weights_truncated", truncate_weights, 2, "truncated"),
    Case("weights_garbage", file_bytes("model.safetensors", os.urandom(4096)), 2, "re-download"),
    Case("weights_header_length_huge", weights_header_too_long, 2, "truncated"),
    Case("weights_index_missing_shard", missing_shard, 2, "missing"),
    # remote code (auto_map)
    Case("remote_code_without_trust", remote_code(REMOTE_OK, trust=False), 3, "--trust-remote-code"),
    Case("remote_code_dotdot", remote_code({"AutoConfig": "../../x/settings.Cfg",
                                             "AutoModelForCausalLM": "../../x/settings.Model"}), 2,
         "only files inside the repo"),
    Case("remote_code_absolute", remote_code({"AutoConfig": "/etc/passwd.Cfg",
                                               "AutoModelForCausalLM": "/etc/passwd.Model"}), 2, "inside the repo"),
    Case("remote_code_symlink_out", remote_code(REMOTE_OK, {"configuration_custom.py": "class CustomConfig: pass\n"},
                                                link="modeling_custom.py"), 2, "outside the model directory"),
    Case("remote_module_collides_with_recipe", remote_code(REMOTE_OK, REMOTE_FILES), 3, "model_setting"),
    Case("remote_auto_map_not_string", config(auto_map={"AutoConfig": 5}), 2, "auto_map"),
    # YAML / JSON through the one bounded loader (engine.safe_load): refused with file and line, never expanded
    Case("recipe_yaml_alias_bomb_in_config_overrides", recipe_yaml(alias_bomb(9, 9)), 2, "expands to more than"),
    Case("recipe_yaml_alias_bomb_wide", recipe_yaml(alias_bomb(4, 60), "deep/other.yml"), 2, "expands to more than"),
    Case("recipe_yaml_recursive_alias", recipe_yaml(b"model_name: r\nmodel_config: &m\n  config_overrides: *m\n"), 2,
         "recursive"),
    Case("recipe_yaml_duplicate_key", recipe_yaml(b"model_name: r\nmodel_config:\n  dtype: float16\n  dtype: float32\n"),
         2, "duplicate key 'dtype'"),
    Case("recipe_yaml_not_utf8", recipe_yaml(b"model_name: r\n# caf\xe9\nmodel_config: {}\n"), 2, "not UTF-8"),
    Case("recipe_yaml_binary", recipe_yaml(bytes(range(256)) * 4), 2, "not UTF-8"),
    Case("standin_upstream_yaml_binary", recipe_yaml(bytes(range(256)) * 4, "legacy.yaml", "--standin"), 2,
         "not UTF-8"),
    Case("standin_upstream_yaml_bomb", recipe_yaml(alias_bomb(8, 12), "legacy.yaml", "--standin", "--tiny"), 2,
         "expands to more than"),
    Case("recipe_yaml_nested_deep", recipe_yaml(b"model_name: " + b"[" * 5000 + b"]" * 5000 + b"\n"), 2, "nested deeper"),
    Case("config_duplicate_key", lambda tmp, ckpt: config_bytes(
        (ckpt / "config.json").read_bytes().rstrip()[:-1] + b', "vocab_size": 5}')(tmp, ckpt), 2, "duplicate key 'vocab_size'"),
    Case("tokenizer_config_duplicate_key", file_bytes("tokenizer_config.json", b'{"eos_token": "a",\n "eos_token": "b"}'),
         2, "duplicate key 'eos_token' at line 2"),
    Case("generation_config_not_utf8", file_bytes("generation_config.json", b'{"eos_token_id": 2, "x": "\xc3"}'), 2,
         "not UTF-8"),
    # found checking #31.2 by variants: values the parser's own type constructors reject were Python's ValueError
    Case("recipe_yaml_impossible_date", recipe_yaml(b"model_name: r\nmodel_config:\n  released: 2001-13-45\n"), 2,
         "'2001-13-45' cannot be read as timestamp"),
    Case("recipe_yaml_int_tag_on_text", recipe_yaml(b"model_name: r\ndata_config:\n  batch_size: !!int 'four'\n"), 2,
         "cannot be read as int"),
    Case("recipe_yaml_empty_float_tag", recipe_yaml(b"model_name: r\nmodel_config:\n  rope_theta: !!float ''\n"), 2,
         "cannot be read as float"),
    Case("recipe_yaml_hex_of_5000_digits", recipe_yaml(b"model_name: r\nseed: 0x" + b"f" * 5000 + b"\n"), 2,
         "an integer of more than 4300 digits"),
    Case("config_integer_of_5000_digits", lambda tmp, ckpt: config_bytes(
        (ckpt / "config.json").read_bytes().rstrip()[:-1] + b', "seed": ' + b"7" * 5000 + b"}")(tmp, ckpt), 2,
         "a number of 5000 digits"),
    Case("tokenizer_config_integer_of_5000_digits", file_bytes("tokenizer_config.json",
                                                               b'{"model_max_length": ' + b"9" * 5000 + b"}"), 2,
         "a number of 5000 digits"),
    # archives: --transformers-source read member by member, the version first, sizes capped
    Case("transformers_source_member_of_zeros", wheel_of_zeros("transformers/zeros.py", 64 * 2**20), 10, "unpacks to"),
    Case("transformers_source_init_of_zeros", wheel_of_zeros("transformers/__init__.py", 48 * 2**20), 10, "unpacks to"),
    # found by tests/e2e/test_fuzz_inputs.py: a source given to a standalone migration was unpacked into the cache and
    # the workflow started before the "only for a checkout" refusal
    Case("transformers_source_for_a_standalone_recipe", lambda tmp, ckpt: wheel_of_zeros("transformers/x.py", 0)(
        tmp, ckpt)[:-2] + ["--output-dir", str(tmp / "out")], 2, "is for a recipe in a cann-recipes-infer checkout"),
    # found by tests/e2e/test_fuzz_inputs.py: a __version__ of 5000 digits was a ValueError traceback (exit 70)
    Case("transformers_source_version_of_5000_digits", wheel_of_zeros("transformers/x.py", 0, "5" * 5000), 10,
         "outside the supported range"),
    Case("transformers_source_old_release_of_zeros", wheel_of_zeros("transformers/big.py", 8 * 2**20, "4.57.1"), 10,
         "outside the supported range"),
    # a received recipe's own state is input: journals, manifests, records schema-checked before any change
    Case("rollback_journal_setuid_mode", forged_state([{"path": "infer.sh", "was": "file", "mode": 0o4755}]), 2,
         "not permission bits"),
    Case("rollback_journal_setgid_sticky_mode", forged_state([{"path": "infer.sh", "was": "file", "mode": 0o3777}]), 2,
         "setuid, setgid and sticky"),
    Case("rollback_journal_mode_huge", forged_state([{"path": "infer.sh", "was": "file", "mode": 2**40}]), 2,
         "not permission bits"),
    Case("rollback_journal_mode_string", forged_state([{"path": "infer.sh", "was": "file", "mode": "4755"}]), 2,
         "not permission bits"),
    Case("rollback_journal_link_absolute", forged_state([{"path": "models/x.py", "was": "link", "target": "/etc/passwd"}]),
         2, "outside the recipe"),
    Case("rollback_journal_link_dotdot", forged_state([{"path": "a/b.py", "was": "link", "target": "../../../victim.py"}]),
         2, "outside the recipe"),
    Case("rollback_journal_path_dotdot", forged_state([{"path": "../victim.py", "was": "file", "mode": 0o644}],
                                                      saved={"x": b"x"}), 2, "not a recipe file path"),
    Case("rollback_journal_path_absolute", forged_state([{"path": "{tmp}/victim.py", "was": "absent"}]), 2,
         "not a recipe file path"),
    Case("rollback_journal_path_backslash", forged_state([{"path": "..\\victim.py", "was": "absent"}]), 2,
         "not a recipe file path"),
    Case("rollback_journal_unknown_kind", forged_state([{"path": "dev", "was": "device", "major": 1}]), 2,
         "not a backup entry"),
    Case("rollback_journal_extra_field", forged_state([{"path": "infer.sh", "was": "file", "mode": 0o755,
                                                        "owner": "root"}]), 2, "not a backup entry"),
    Case("rollback_journal_file_never_saved", forged_state([{"path": "evil.sh", "was": "file", "mode": 0o755}]), 2,
         "missing from the backup"),
    Case("rollback_manifest_absolute", forged_state(manifest=["{tmp}/victim.py"]), 2, "not a recipe file path"),
    Case("rollback_manifest_not_list", forged_state(manifest={"infer.sh": 1}), 2, "not a list"),
    Case("rollback_registry_record_names_another_file", forged_state(record={
        "registry": "{tmp}/victim.py", "name": "x", "offset": 9, "inserted": "INSERTED = 2\n"}), 2, "edits no other file"),
    # found by tests/e2e/test_fuzz_inputs.py: a record of another shape was "nothing recorded" (exit 0), not refused
    Case("rollback_registry_record_missing_fields", forged_state(record={"runs": -5}), 2, "no registry or inserted"),
    Case("rollback_registry_record_a_list", forged_state(record=["{tmp}/victim.py"]), 2, "not a JSON object"),
    Case("rollback_registry_record_not_json", forged_state(record="{{'registry': '{tmp}/victim.py'"), 2,
         "not a record this tool wrote"),
    Case("rollback_registry_record_wrong_type", forged_state(record={
        "registry": "{tmp}/victim.py", "name": "x", "offset": "9", "inserted": "INSERTED = 2\n"}), 2, "not a int"),
    # a recipe folder another command writes (folder_lock): every writer answers 75 naming the holder
    Case("run_recipe_locked", recipe_locked("run"), 75, "being written by another migrator command (pid 4242"),
    # found by tests/e2e/test_fuzz_inputs.py: `baseline` recorded a bad recipe file as an error row, exit 1, no line
    Case("baseline_recipe_yaml_alias_bomb", as_baseline(recipe_yaml(alias_bomb(9, 9))), 2, "expands to more than"),
    Case("baseline_recipe_yaml_not_utf8", as_baseline(recipe_yaml(b"model_name: r\n# caf\xe9\n")), 2, "not UTF-8"),
    Case("baseline_recipe_entry_symlink_loop", as_baseline(recipe_entry_loop), 2, "symlink loop"),
    Case("baseline_of_a_checkpoint", args("baseline", "{ckpt}", "--summary", "{tmp}/out/summary"), 2,
         "a checkpoint, not a recipe"),
    Case("baseline_recipe_locked", recipe_locked("baseline", "--summary", "{tmp}/out/summary"), 75,
         "being written by another migrator command (pid 4242"),
    Case("rollback_recipe_locked", recipe_locked("rollback"), 75, "being written by another migrator command"),
    # found by tests/e2e/test_fuzz_inputs.py: with --resume the target was not checked; a folder that is no recipe
    # (its infer.sh a folder) started a migration whose store went to ./models
    Case("resume_recipe_infer_sh_a_folder", lambda tmp, ckpt: recipe_yaml(b"model_name: r\n")(tmp, ckpt) and
         ((tmp / "recipe" / "infer.sh").unlink() or (tmp / "recipe" / "infer.sh").mkdir() or
          ["run", str(tmp / "recipe"), "--resume", "--output-dir", str(tmp / "out")]), 2, "not a recipe"),
    Case("resume_a_file", args("run", "{ckpt}/config.json", "--resume"), 2, "not a directory"),
    Case("resume_config_json_fifo", lambda tmp, ckpt: special_file("config.json", "fifo")(tmp, ckpt) + ["--resume"], 2,
         "FIFO"),
    # found by tests/e2e/test_fuzz_inputs.py (a full run): writes through a link out of the recipe, #31.1's class
    # (refused by engine.safe_write before the run starts)
    Case("recipe_runs_folder_symlinked_out", rendered_recipe_with_link(".migrator/runs"), 2, ".migrator/runs"),
    # found by tests/e2e/test_fuzz_inputs.py: a store file that is a folder was an IsADirectoryError traceback (exit 70)
    Case("resume_store_threads_json_a_folder", lambda tmp, ckpt: recipe_yaml(b"model_name: r\n")(tmp, ckpt) and
         ((tmp / "recipe" / ".migrator" / "threads.json").mkdir(parents=True) or
          ["run", str(tmp / "recipe"), "--resume"]), 2, "not a regular file"),
    Case("recipe_store_checkpoints_sqlite_a_fifo", lambda tmp, ckpt: recipe_yaml(b"model_name: r\n")(tmp, ckpt) and
         ((tmp / "recipe" / ".migrator").mkdir() or os.mkfifo(tmp / "recipe" / ".migrator" / "checkpoints.sqlite") or
          ["run", str(tmp / "recipe")]), 2, "not a regular file"),
    # found by tests/e2e/test_fuzz_inputs.py: classifying a recipe read a sparse 4 GiB infer.sh in full (a hang)
    Case("recipe_infer_sh_sparse_4_gib", lambda tmp, ckpt: recipe_yaml(bytes(range(256)) * 4)(tmp, ckpt) and
         (os.truncate(tmp / "recipe" / "infer.sh", 4 * 2**30) or ["run", str(tmp / "recipe")]), 2, "not UTF-8"),
    # found by tests/e2e/test_fuzz_inputs.py: `~name` of no user was a RuntimeError traceback (exit 70) wherever used
    Case("target_tilde_of_no_user", args("run", "~no_such_user_x/Model"), 2, "names no user"),
    Case("output_dir_tilde_of_no_user", args("run", "{ckpt}", "--output-dir", "~no_such_user_x/out"), 2,
         "names no user"),
    Case("baseline_tilde_of_no_user", args("baseline", "~no_such_user_x", "--summary", "{tmp}/out/summary"), 2,
         "names no user"),
    Case("rollback_tilde_of_no_user", args("rollback", "~no_such_user_x/r"), 2, "names no user"),
    # found by tests/e2e/test_fuzz_inputs.py (FUZZ_EXAMPLES=60): pathlib reads './~x' as '~x', so the check of the
    # raw string let it through to expanduser (a RuntimeError, exit 70)
    Case("target_dot_slash_tilde_of_no_user", args("run", "./~%25a%25"), 2, "'~%25a%25' names no user"),
    Case("output_dir_dot_slash_tilde_of_no_user", args("run", "{ckpt}", "--output-dir", ".//~no_such_user_x/o"), 2,
         "names no user"),
    # other commands
    Case("classify_missing_path", args("classify", "{tmp}/nope"), 2, "no such file"),
    Case("rollback_not_a_recipe", args("rollback", "{tmp}/nope"), 2, "no such recipe"),
    Case("baseline_timeout_negative", args("baseline", "{tmp}", "--timeout", "-5"), 2, "out of range"),
]


def _tree(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == skip or skip in here.parents:
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            path = here / name
            stat = path.lstat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def _param(case: Case):
    if case.known:            # a trial run: slow; fails until the issue named lands
        return pytest.param(case, id=case.id, marks=[pytest.mark.slow, pytest.mark.xfail(reason=case.known, strict=True)])
    return pytest.param(case, id=case.id)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "out" / "ms_cache"))   # inside --output-dir: not "outside"
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "ckpt").mkdir()
    ckpt = tmp_path / "ckpt" / "model"
    shutil.copytree(demo_model_dir(), ckpt)
    out = tmp_path / "out"
    argv = case.setup(tmp_path, ckpt)
    if argv[0] == "run" and "--output-dir" not in argv:
        argv += ["--output-dir", str(out)]
    if argv[0] == "run" and "--device" not in argv:
        argv += ["--device", "cpu"]
    before = _tree(tmp_path, skip=out)
    had = {p.name for p in out.iterdir()} if out.is_dir() else set()      # what the setup put there
    capsys.readouterr()

    try:
        code = main(argv)
    finally:
        while _HELD_ELSEWHERE:
            os.close(_HELD_ELSEWHERE.pop())

    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    error_lines = [ln for ln in err.splitlines() if not ln.startswith("[migrator]")]
    assert len(error_lines) == 1 and error_lines[0].startswith("migrator: error: "), err
    assert code == case.code, err
    assert code != errors.EXIT_INTERNAL
    assert case.says.lower() in error_lines[0].lower(), error_lines[0]
    # Nothing written outside --output-dir (the checkpoint included), no code from the input ran.
    assert _tree(tmp_path, skip=out) == before
    assert not any(p.name == MARKER for p in tmp_path.rglob("*"))
    # No half-built recipe: the output dir holds at most the checkpoint store, and what the user had.
    if out.is_dir():
        # the checkpoint store, baseline's table, and the ModelScope library's own cache (this test puts it there)
        leftovers = {p.name for p in out.iterdir()} - {".migrator", "summary.md", "summary.csv", "ms_cache"}
        assert leftovers == had - {".migrator"}, leftovers
    if case.setup is recipe_exists:
        assert (out / "my_model" / "keep.txt").read_text() == "user's file"


def test_a_million_layers_on_two_layer_weights_is_refused_in_seconds(tmp_path):
    """The pre-flight costs what the files cost: the config's layer count is compared with the
    weights before any model is built (transformers would build 1000000 layers: minutes, GBs)."""
    import time
    import tracemalloc

    from agent.migrate.checkpoint_check import check_checkpoint

    ckpt = tmp_path / "model"
    shutil.copytree(demo_model_dir(), ckpt)
    data = _cfg(ckpt)
    check_checkpoint(ckpt)      # the imports (transformers) once, outside the measure: a fresh worker has none
    (ckpt / "config.json").write_text(json.dumps(dict(data, num_hidden_layers=1000000)))
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(errors.InputError, match="num_hidden_layers 1000000"):
        check_checkpoint(ckpt)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 10 and peak < 200 * 2**20, (seconds, peak)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "1.5G", "8 bytes"])
def test_malformed_simulated_card_size_is_one_line_exit_2(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MIGRATOR_DEVICE_MEMORY_BYTES", value)
    code = main(["run", str(demo_model_dir()), "--output-dir", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("migrator")]
    assert code == 2 and len(lines) == 1 and "MIGRATOR_DEVICE_MEMORY_BYTES" in lines[0] and "8G" in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, expected", [("8589934592", 8 * 2**30), ("8G", 8 * 2**30), ("512MiB", 512 * 2**20),
                                             (" 64k ", 64 * 1024), ("", None)])
def test_simulated_card_size_accepts_bytes_and_suffixes(value, expected):
    from engine.environment import simulated_card_bytes

    assert simulated_card_bytes({"MIGRATOR_DEVICE_MEMORY_BYTES": value}) == expected


def test_layer_count_is_what_the_code_builds_not_the_config_name(tmp_path):
    """dory builds its layers from layer_types and loop counts, not num_hidden_layers: its own
    weights hold fewer `layers.N` than that name says and must not be refused (found by the
    --all sweep); a llama config of more layers than its weights still is (config_with_more_layers)."""
    from agent.migrate.checkpoint_check import check_checkpoint, layers_the_code_builds
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("dory", tmp_path / "dory", num_hidden_layers=4)
    config = json.loads((ckpt / "config.json").read_text())
    built = layers_the_code_builds(config)
    assert built is not None and built < config["num_hidden_layers"]
    assert config["n_recurrent_layers"] >= 1        # the tiny config is a real looped model (TYPE_DIMS)
    assert check_checkpoint(ckpt)["model_type"] == "dory"
    assert layers_the_code_builds({**config, "auto_map": {"AutoConfig": "x.Y"}}) is None   # runs no remote code


@pytest.mark.parametrize("name, value", [("HF_ENDPOINT", "https://hf-mirror.com"), ("HF_ENDPOINT", "http://[::1]:8080/"),
                                         ("MODELSCOPE_ENDPOINT", "modelscope.cn"), ("MODELSCOPE_DOMAIN", "www.modelscope.ai"),
                                         ("MIGRATOR_LLM_BASE_URL", "http://127.0.0.1:8000/v1"), ("HF_ENDPOINT", "")])
def test_url_variables_that_their_readers_accept_pass_the_input_step(name, value):
    from agent.workflow.inputs import check_environment

    check_environment("run", {name: value})       # raises InputError for a value the tool would refuse
