"""Rules from field reports: failures people hit running recipes (see tests/field_faults/README.md).

Each rule's evidence is the message as it shows in the reports (copied into
tests/field_faults/corpus.yaml). Rules with a safe fix apply it (codemods through
agent.codemods.device, line-ending repair, a YAML dtype edit); the others are report-only: the
fix changes nothing and returns a precise diagnosis with the next step, so the repair loop stops
with that note instead of "unknown failure". NPU kernels with no portable equivalent
(torch_npu.npu_*, torch.ops.npu.*) are not matched here.

EARLIEST goes before every rule (a recipe YAML that does not parse breaks other matchers), FIRST
before agent.repair_rules.code (a missing torch_npu is not a pip package to install when only
incidental calls need it; a tokenizer's missing SentencePiece is not the tiktoken its fallback asks
for), RULES after it (agent.repair_rules.catalogue orders them).
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.codemods.device import CUDA_COMMANDS, NPU_COMMANDS, npu_kernel_uses
from agent.codemods.repair import RopeScalingTypeKeyCommand, rewrite_file
from agent.failure import Failure
from agent.repair_rules._util import edit_yaml_line, load_yaml, recipe_yaml
from agent.repair_rules.code import _fix_missing_package, install_command, recipe_py_files
from agent.repair_rules.rule import RepairContext, Rule, message_facts, report, where_it_failed


# ---- incidental NPU calls on a host without torch_npu -------------------------------------
# "import of torch_npu halted": torch_npu is installed but cannot load (no CANN, a broken build);
# engine.environment's probe imported it once, saw it fail and blocked it (None in sys.modules) so
# that torch and transformers run without it; the recipe's own `import torch_npu` then says only this.
_NPU_MISSING = re.compile(
    r"module 'torch' has no attribute 'npu'|No module named 'torch_npu'|No module named 'torchair'|"
    r"object has no attribute 'npu'|"
    r"device type at start of device string: npu|Failed to import torch_npu|"
    r"import of torch_npu halted; None in sys\.modules|"
    r"(?:libhccl|libascend_hal|libascendcl)\.so: cannot open shared object file")
_NPU_BLOCKED = "import of torch_npu halted; None in sys.modules"


def _incidental_npu_facts(failure: Failure, found: re.Match) -> dict | None:
    files, kernels = [], []
    for path in recipe_py_files(failure.recipe_dir):
        text = path.read_text(errors="replace")
        kernels += npu_kernel_uses(text)
        if ("npu" in text or "torchair" in text) and rewrite_file(path, NPU_COMMANDS, dry_run=True):
            files.append(str(path.relative_to(failure.recipe_dir)))
    if kernels or not files:
        return None         # kernels: no portable equivalent (exit 4); nothing incidental: not ours
    return {"files": files}


def _fix_incidental_npu(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        rewrite_file(failure.recipe_dir / rel, NPU_COMMANDS)
    return (f"incidental NPU calls in {', '.join(facts['files'])} now go through engine.device_ops "
            "(NPU behaviour kept on an NPU; CUDA and CPU run too)")


# ---- torch_npu imported from its (unbuilt) source tree -------------------------------------
_NPU_SOURCE_TREE = re.compile(r"No module named 'torch_npu\._C'|" + re.escape(_NPU_BLOCKED))


def torch_npu_package_dir(recipe_dir: Path) -> Path | None:
    """The torch_npu package folder a run of the recipe imports (infer.sh puts the recipe first on
    PYTHONPATH, then the caller's PYTHONPATH, then the interpreter's path), or None."""
    import importlib.machinery
    import os
    import sys

    paths = [str(recipe_dir), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *sys.path]
    try:
        spec = importlib.machinery.PathFinder.find_spec("torch_npu", paths)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _source_tree_facts(failure: Failure, found: re.Match) -> dict | None:
    """The message names torch_npu._C; or torch_npu was blocked after failing to import and the
    torch_npu the recipe imports is a source checkout: no compiled extension (torch_npu/_C*.so) in it."""
    facts = message_facts(failure, found)
    if found.group(0) != _NPU_BLOCKED:
        return facts
    package = torch_npu_package_dir(failure.recipe_dir)
    if package is None or any(package.glob("_C*.so")) or any(package.glob("_C*.pyd")):
        return None
    return dict(facts, source_tree=str(package))


# ---- incidental CUDA calls on a host without CUDA ----------------------------------------
_CUDA_MISSING = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available|"
    r"CUDA driver initialization failed|module 'torch\._C' has no attribute '_cuda_\w+'|no CUDA-capable device")


def _incidental_cuda_facts(failure: Failure, found: re.Match) -> dict | None:
    files = [str(p.relative_to(failure.recipe_dir)) for p in recipe_py_files(failure.recipe_dir)
             if "torch.cuda." in p.read_text(errors="replace") and rewrite_file(p, CUDA_COMMANDS, dry_run=True)]
    return {"files": files} if files else None


def _fix_incidental_cuda(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        rewrite_file(failure.recipe_dir / rel, CUDA_COMMANDS)
    return f"torch.cuda bookkeeping calls in {', '.join(facts['files'])} now go through engine.device_ops"


# ---- shell scripts with CRLF line endings -------------------------------------------------
# bash's complaint about a script (a run's output is read with universal newlines, so the "\r" in
# "pipefail\r: invalid option name" may already be a line break; the script's own bytes decide).
_CRLF_ERROR = re.compile(r"\.sh: line \d+: ")


def _crlf_facts(failure: Failure, found: re.Match) -> dict | None:
    files = [p.name for p in sorted(failure.recipe_dir.glob("*.sh")) if b"\r\n" in p.read_bytes()]
    return {"files": files} if files else None


def _fix_crlf(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for name in facts["files"]:
        path = failure.recipe_dir / name
        path.write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))   # mode kept: same inode
    return f"converted {', '.join(facts['files'])} from CRLF (Windows) to LF line endings"


# ---- mixed dtypes in recipe code ----------------------------------------------------------
_MIXED_DTYPE = re.compile(r"expected scalar type (\w+) but found (\w+)|expected m(?:at)?1 and m(?:at)?2 to have the "
                          r"same dtype, but got: ([\w:]+) != ([\w:]+)|Input type \((\w+)\) and bias type \((\w+)\)")


def _mixed_dtype_facts(failure: Failure, found: re.Match) -> dict | None:
    dtype = (load_yaml(failure.recipe_dir).get("model_config") or {}).get("dtype")
    types = " and ".join(g for g in found.groups() if g)
    return {"dtype": dtype, "types": types, "where": where_it_failed(failure), "fixable": dtype in ("bfloat16", "float16")}


def _fix_mixed_dtype(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if facts["fixable"]:
        note = edit_yaml_line(failure.recipe_dir, "model_config", "dtype", "float32")
        return f"{note}: tensors of {facts['types']} met at {facts['where']}; one dtype (float32) everywhere"
    return (f"tensors of {facts['types']} meet at {facts['where']} although model_config.dtype is {facts['dtype']}: "
            "recipe code creates a tensor in another dtype; cast it with .to(<weights>.dtype) there")


# ---- the SentencePiece / tiktoken / protobuf backend of a tokenizer is missing -------------
_TOKENIZER_BACKEND = re.compile(r"(\w+) requires the (SentencePiece|protobuf|tiktoken|Tokenizers) library but it "
                                r"was not found in your environment")
_BACKEND_DIST = {"SentencePiece": "sentencepiece", "protobuf": "protobuf", "tiktoken": "tiktoken",
                 "Tokenizers": "tokenizers"}


def _tokenizer_backend_facts(failure: Failure, found: re.Match) -> dict | None:
    dist = _BACKEND_DIST[found.group(2)]
    return {"module": dist, "distribution": dist, "install": install_command(dist), "class": found.group(1)}


# ---- vendored code reads an old rope_scaling schema --------------------------------------
_ROPE = re.compile(r"KeyError: '(type|rope_type|factor|original_max_position_embeddings)'|`rope_scaling` must be a "
                   r"dictionary with (?:with )?two fields|Unknown RoPE scaling type (\w+)")


def _rope_facts(failure: Failure, found: re.Match) -> dict | None:
    if found.group(1) and "rope" not in failure.output:
        return None
    key = found.group(1) or found.group(2) or "type/factor"
    files = []
    if key == "type":
        files = [str(p.relative_to(failure.recipe_dir)) for p in recipe_py_files(failure.recipe_dir)
                 if "rope_scaling" in p.read_text(errors="replace") and rewrite_file(p, [RopeScalingTypeKeyCommand], dry_run=True)]
    return {"key": key, "where": where_it_failed(failure), "files": files}


def _fix_rope(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if facts["files"]:
        for rel in facts["files"]:
            rewrite_file(failure.recipe_dir / rel, [RopeScalingTypeKeyCommand])
        return (f"rope_scaling['type'] now reads .get('type', .get('rope_type')) in {', '.join(facts['files'])} "
                "(transformers >= 4.45 renamed the key)")
    return (f"rope_scaling key {facts['key']!r} at {facts['where']}: transformers >= 4.45 stores "
            "rope_scaling['rope_type'] (was 'type') and fills defaults; read it with .get(...) in the vendored "
            "code, or pin the transformers release the code was written for")


# ---- safetensors shards that are not safetensors ------------------------------------------
_SAFETENSORS = re.compile(r"SafetensorError: Error while deserializing header: (HeaderTooLarge|header too large|"
                          r"InvalidHeaderDeserialization|MetadataIncompleteBuffer)")


def _safetensors_facts(failure: Failure, found: re.Match) -> dict | None:
    model_path = Path(str(load_yaml(failure.recipe_dir).get("model_path") or ""))
    if model_path and not model_path.is_absolute():
        model_path = failure.recipe_dir / model_path
    pointers = []
    if model_path.is_dir():
        for shard in sorted(model_path.glob("*.safetensors")):
            with open(shard, "rb") as f:
                if f.read(40).startswith(b"version https://git-lfs"):
                    pointers.append(shard.name)
    why = (f"{', '.join(pointers)} are git-lfs pointer files, not weights: run `git lfs pull` in {model_path}"
           if pointers else f"a shard under {model_path or 'model_path'} is truncated or not a safetensors file: "
                            "re-download it and compare its size with the hub's")
    return {"error": found.group(1), "why": why}



# ---- checkpoint tensors of other shapes than the config's model ----------------------------
# torch's load_state_dict message, and transformers >= 5's load report row (printed before its
# "You set `ignore_mismatched_sizes` to `False`, thus raising an error").
_SIZE = r"torch\.Size\(\[[\d, ]*\]\)"
_SHAPE_MISMATCH = re.compile(
    rf"size mismatch for (?P<param>[\w.]+): copying a param with shape (?P<ckpt>{_SIZE}) "
    rf"from checkpoint, the shape in current model is (?P<model>{_SIZE})|"
    rf"^(?P<param5>[\w.]+)\s*\|\s*MISMATCH\s*\|\s*Reinit due to size mismatch - ckpt: (?P<ckpt5>{_SIZE}) "
    rf"vs model:\s*(?P<model5>{_SIZE})", re.M)


def _shape_facts(failure: Failure, found: re.Match) -> dict:
    facts = message_facts(failure, found)
    for key in ("param", "ckpt", "model"):
        facts[key] = facts.pop(key + "5", None) or facts.get(key)
    return facts


# ---- the recipe YAML does not parse -------------------------------------------------------
_YAML_ERROR = re.compile(r"\b(ScannerError|ParserError|ComposerError|ConstructorError)\b|not valid YAML")


def _yaml_syntax_facts(failure: Failure, found: re.Match) -> dict | None:
    """The recipe YAML really does not parse: where, from our own parse."""
    import yaml

    path = recipe_yaml(failure.recipe_dir)
    if path is None:
        return None
    try:
        yaml.safe_load(path.read_text())
        return None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        lines = path.read_text().splitlines()
        text = lines[mark.line].rstrip() if mark and mark.line < len(lines) else ""
        return {"file": str(path.relative_to(failure.recipe_dir)), "line": mark.line + 1 if mark else 0,
                "col": mark.column + 1 if mark else 0, "kind": type(exc).__name__, "problem": exc.problem or "",
                "text": text}
    except yaml.YAMLError as exc:
        return {"file": str(path.relative_to(failure.recipe_dir)), "line": 0, "col": 0,
                "kind": type(exc).__name__, "problem": str(exc).splitlines()[0], "text": ""}

def _fix_one_slip(lines: list[str], exc) -> str | None:
    """Fix the slip PyYAML points at (a tab in the indentation, a missing space after ':', an
    indentation off by a space, an unquoted value holding ': '), in place; returns what was done."""
    import json
    import re

    mark = exc.context_mark if exc.context == "while scanning a simple key" and exc.context_mark else exc.problem_mark
    if mark is None or mark.line >= len(lines):
        return None
    at = mark.line
    line = lines[at]
    indent = re.match(r"[ \t]*", line).group(0)
    if "\t" in indent:
        lines[at] = indent.replace("\t", "  ") + line[len(indent):]
        return f"line {at + 1}: a tab in the indentation replaced by spaces"
    key = re.match(r"^(\s*)([A-Za-z_][\w.-]*):(\S.*)$", line)
    if exc.problem == "could not find expected ':'" and key and not key.group(3).startswith(("//", ":")):
        lines[at] = f"{key.group(1)}{key.group(2)}: {key.group(3)}"
        return f"line {at + 1}: a space added after '{key.group(2)}:'"
    if exc.problem == "mapping values are not allowed here":
        previous = next((ln for ln in reversed(lines[:at]) if ln.strip() and not ln.lstrip().startswith("#")), "")
        prev_indent = len(previous) - len(previous.lstrip())
        want = prev_indent + 2 if previous.rstrip().endswith(":") else prev_indent
        if len(indent) != want and abs(len(indent) - want) == 1:
            lines[at] = " " * want + line.lstrip()
            return f"line {at + 1}: indentation aligned with the line above"
        pair = re.match(r"^(\s*)([A-Za-z_][\w.-]*):\s+(.*\S)\s*$", line)
        from engine.config import KEYS

        choices = {key.leaf for key in KEYS if key.choices}      # exe_mode: eager: fast has no one reading
        if pair and ": " in pair.group(3) and not pair.group(3).startswith(("'", '"', "{", "[")) \
                and pair.group(2) not in choices:
            lines[at] = f"{pair.group(1)}{pair.group(2)}: {json.dumps(pair.group(3), ensure_ascii=False)}"
            return f"line {at + 1}: the value of '{pair.group(2)}' (it holds ': ') quoted"
    return None


def _fix_yaml_syntax(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    """The slips the diagnosis names, fixed one at a time at the place PyYAML reports, until the
    YAML parses as a mapping; if it does not, nothing is written and the diagnosis stands."""
    import yaml

    from agent.repair_rules._util import read_source, write_source

    path = failure.recipe_dir / facts["file"]
    original = path.read_bytes()
    lines = read_source(path).split("\n")
    done = []
    for _ in range(20):
        try:
            data = yaml.safe_load("\n".join(lines))
        except yaml.MarkedYAMLError as exc:
            what = _fix_one_slip(lines, exc)
            if what is None:
                break
            done.append(what)
            continue
        except yaml.YAMLError:
            break
        if isinstance(data, dict) and done:
            write_source(path, "\n".join(lines), original)
            return f"{facts['file']}: " + "; ".join(done)
        break
    return report("{file} line {line} column {col} is not valid YAML ({kind}): {problem}: {text!r}; typical "
                  "causes: a missing space after ':', a tab in the indentation, an unquoted value containing ': ' "
                  "(quote it)")(failure, facts, ctx)


# Before every other rule: matchers of later rules read the recipe YAML, which does not parse.
EARLIEST: list[Rule] = [
    Rule("recipe_yaml_syntax_error", _YAML_ERROR,
         "the recipe YAML is not valid YAML",
         _fix_yaml_syntax, facts=_yaml_syntax_facts, kind="yaml"),
]

FIRST: list[Rule] = [
    # Before incidental_npu_call: a recipe importing torch_npu from a source tree is not fixed by
    # guarding the import (on an NPU host it would then run without the NPU).
    Rule("torch_npu_imported_from_source_tree", _NPU_SOURCE_TREE,
         "torch_npu is imported from its own source tree (torch_npu._C is missing)",
         report("`import torch_npu` picked up the torch_npu source directory instead of the installed package "
                "({where}): run infer.sh from a directory that is not the torch_npu source tree"),
         facts=_source_tree_facts, kind="report"),
    Rule("incidental_npu_call", _NPU_MISSING,
         "recipe code makes NPU bookkeeping calls (torch.npu.*, .npu(), device=\"npu\", import torch_npu) on a "
         "host without torch_npu",
         _fix_incidental_npu,
         facts=_incidental_npu_facts, kind="codemod"),
    Rule("torch_npu_backend_autoload_failed", re.compile(r"Failed to load the backend extension: torch_npu"),
         "torch_npu is installed but cannot load, so `import torch` itself fails (backend autoload)",
         report("torch >= 2.5 auto-loads torch_npu at `import torch` and that failed ({where}): on a host without "
                "CANN run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or uninstall torch_npu); on an NPU host source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh and install the torch_npu built for this torch"),
         kind="report"),
    Rule("torch_npu_without_cann",
         re.compile(r"(?P<lib>lib(?:hccl|ascend_hal|ascendcl|atb|acl_op_compiler|ge_runner|runtime)\.so)\S*: cannot open "
                    r"shared object file"),
         "torch_npu cannot load the CANN runtime libraries (CANN not installed or set_env.sh not sourced)",
         report("{lib} is missing ({where}): source /usr/local/Ascend/ascend-toolkit/set_env.sh (and the driver's "
                "LD_LIBRARY_PATH) before infer.sh, or run on CPU/CUDA without torch_npu installed"),
         kind="report"),
    # Before missing_pip_package: transformers >= 5 falls back to tiktoken when SentencePiece is
    # missing, and the error it raises is about tiktoken ("No module named 'tiktoken'"); the
    # tokenizer needs the library the output names first.
    Rule("tokenizer_backend_missing", _TOKENIZER_BACKEND,
         "the tokenizer needs a library (SentencePiece, protobuf, tiktoken) not installed",
         _fix_missing_package,
         facts=_tokenizer_backend_facts, kind="report"),
]

RULES: list[Rule] = [
    Rule("incidental_cuda_call", _CUDA_MISSING,
         "recipe code makes CUDA bookkeeping calls (torch.cuda.set_device, Event, memory stats...) without CUDA",
         _fix_incidental_cuda,
         facts=_incidental_cuda_facts, kind="codemod"),
    Rule("shell_script_crlf", _CRLF_ERROR,
         "a recipe shell script has Windows (CRLF) line endings",
         _fix_crlf,
         facts=_crlf_facts, where=("output",), kind="infer.sh", keeps_format=False),
    Rule("shell_script_not_executable", re.compile(r"(?P<script>\S+\.sh): Permission denied"),
         "a recipe script is run as ./script but is not executable",
         report("{script} is not executable: run it as `bash {script}` (what migrator does) or chmod +x it"),
         kind="report"),
    Rule("npu_device_id_invalid",
         re.compile(r"invalid device=\d+, input visible devices:[\d,]*|open device \d+ failed, runtime result = 107001|"
                    r"Invalid device (?:ID|id)|SetDevice\(device_id_\), error code is 507033"),
         "the NPU id a rank asks for is not visible (ASCEND_RT_VISIBLE_DEVICES / world_size)",
         report("{message}: ranks are numbered from 0 within ASCEND_RT_VISIBLE_DEVICES; list ascending, existing "
                "ids (see npu-smi info) and keep world_size <= their count"),
         kind="report"),
    Rule("npu_device_busy",
         re.compile(r"because the device is used\. ret is -8020|Maybe the last training process is running|"
                    r"dcmi module initialize failed\. ret is -8005"),
         "the NPU is held by another process",
         report("{message}: another process holds the NPU: check `npu-smi info` for running processes, stop them "
                "and wait ~10 s, or pick a free device with ASCEND_RT_VISIBLE_DEVICES"),
         kind="report"),
    Rule("cann_runtime_init_failed",
         re.compile(r"EH9999[^\n]*\n?[^\n]*init env failed|ERR00100 PTA call acl api failed|"
                    r"Inner Error!\s*\n?\s*EH9999"),
         "the CANN runtime failed to initialise (driver / dependencies)",
         report("{message}: the CANN runtime could not start: check the driver with `npu-smi info`, that the CANN "
                "version matches the driver, and CANN's Python dependencies (decorator, sympy, cffi, protobuf, "
                "attrs, psutil, scipy)"),
         kind="report"),
    Rule("hccl_init_failed",
         re.compile(r"HcclCommInitRootInfo[^\n]*|HcclCommInitRootConfig[^\n]*|ERR02200 DIST call hccl api failed"),
         "HCCL could not create the communicator between ranks",
         report("{message}: the ranks could not form an HCCL group: every rank must start (world_size), see the "
                "same MASTER_ADDR/MASTER_PORT, and use distinct NPUs; check the device network with "
                "hccn_tool / the HCCL test"),
         kind="report"),
    Rule("hccl_collective_timeout",
         re.compile(r"EI0006[^\n]*|Getting socket times out|Watchdog caught collective operation timeout[^\n]*|"
                    r"HcclAllreduce, error code is \d+"),
         "a collective timed out: some rank did not take part in time",
         report("{message}: a rank is stuck or dead: look at every rank's log for an earlier error, make every "
                "rank run the same number of generate steps, raise HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT only "
                "if the ranks are merely slow"),
         kind="report"),
    Rule("npu_api_version_mismatch",
         re.compile(r"module 'torch_npu(?:\.npu)?' has no attribute '(?P<api>(?!npu_|_npu)\w+)'"),
         "the recipe calls a torch_npu API the installed torch_npu does not have",
         report("torch_npu has no {api} ({where}): the recipe was written for another torch_npu release; install "
                "the torch_npu that matches the recipe's (see requirements.txt) or use that release's API name"),
         kind="report"),
    Rule("static_tls_libgomp", re.compile(r"(?P<lib>\S*libgomp\S*): cannot allocate memory in static TLS block"),
         "libgomp cannot be loaded after other libraries (static TLS exhausted)",
         report("{lib} cannot be loaded late: export LD_PRELOAD={lib} before infer.sh"),
         kind="report"),
    Rule("shared_library_missing", re.compile(r"(?P<lib>lib[\w.+-]+\.so[\d.]*): cannot open shared object file"),
         "a native library a Python package needs is missing",
         report("{lib} is not found ({where}): install the system package providing it or add its directory "
                "to LD_LIBRARY_PATH"),
         kind="report"),
    Rule("transformers_does_not_know_model",
         re.compile(r"model type `(?P<model_type>[\w-]+)` but Transformers does not recognize this architecture"),
         "the installed transformers does not know the checkpoint's model type",
         report("model type {model_type} is unknown to the installed transformers: upgrade transformers, or if "
                "the checkpoint ships its own modeling code re-run with --trust-remote-code after reviewing it"),
         kind="report"),
    Rule("tokenizer_class_unknown",
         re.compile(r"Tokenizer class (?P<cls>\w+) does not exist or is not currently imported"),
         "tokenizer_config.json names a tokenizer class transformers does not have",
         report("tokenizer class {cls} is unknown: fix tokenizer_class in the checkpoint's tokenizer_config.json "
                "(e.g. LLaMATokenizer -> LlamaTokenizer) or install the transformers version it was saved with"),
         kind="report"),
    Rule("transformers_api_moved",
         re.compile(r"cannot import name '(?P<name>\w+)' from '(?P<module>transformers[\w.]*)'|"
                    r"No module named '(?P<submodule>transformers\.[\w.]+)'"),
         "vendored code imports a transformers name this version does not have",
         report("{where}: the vendored code was written for another transformers release ({message}); pin the "
                "transformers version in requirements.txt or update the import to its new location"),
         kind="report"),
    Rule("rope_scaling_schema", _ROPE,
         "vendored code and config disagree on the rope_scaling schema",
         _fix_rope,
         facts=_rope_facts, kind="codemod"),
    Rule("safetensors_header_invalid", _SAFETENSORS,
         "a safetensors shard is not a valid safetensors file",
         report("SafetensorError {error}: {why}"),
         facts=_safetensors_facts, kind="report"),
    Rule("checkpoint_shape_mismatch", _SHAPE_MISMATCH,
         "checkpoint tensors have other shapes than the model built from the config",
         report("{param}: checkpoint {ckpt} vs model {model}: config.json (vocab_size / hidden sizes) does not "
                "describe these weights; use the config that was saved with the checkpoint"),
         facts=_shape_facts, kind="report"),
    Rule("meta_tensor_not_loaded", re.compile(r"Cannot copy out of meta tensor; no data!"),
         "parameters stayed on the meta device (never loaded) and are then moved",
         report("{where}: some weights were never materialised (meta device): their keys are missing from the "
                "checkpoint or device_map offloaded them; do not call .to()/.cuda() on a device_map model"),
         kind="report"),
    Rule("mixed_dtype_in_recipe_code", _MIXED_DTYPE,
         "tensors of two dtypes meet in one operation",
         _fix_mixed_dtype,
         facts=_mixed_dtype_facts, kind="yaml"),
    Rule("non_finite_logits", re.compile(r"probability tensor contains either `?inf`?, `?nan`? or element < 0"),
         "sampling got inf/nan probabilities (numerical overflow)",
         report("{where}: the logits are inf/nan: float16 overflows on many models: use model_config.dtype "
                "bfloat16 or float32, and check the weights loaded (no missing keys)"),
         kind="report"),
    Rule("process_group_not_initialized",
         re.compile(r"Default process group has not been initialized, please make sure to call init_process_group"),
         "a torch.distributed call ran without an initialised process group",
         report("{where}: torch.distributed is used but no process group exists: launch through infer.sh "
                "(engine.launch starts torchrun when world_size > 1) or guard the call with "
                "torch.distributed.is_initialized()"),
         kind="report"),
    Rule("rendezvous_port_in_use",
         re.compile(r"(?:EADDRINUSE|errno: 98 - Address already in use|Address already in use)[^\n]*"),
         "the torchrun rendezvous port is taken by another run",
         report("{message}: another job holds the master port: stop it or export MASTER_PORT=<free port> "
                "before infer.sh"),
         kind="report"),
]

FIELD_RULE_NAMES = frozenset(r.name for r in EARLIEST + FIRST + RULES)
