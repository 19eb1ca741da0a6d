"""Rules whose fix only reports: what the failure is and the next step (out of memory, a timeout,
a package to install, the environment, the checkpoint). The graph sends an out-of-memory diagnosis
to the memory estimate."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


from agent.child_failure import child_failure
from agent.recipe.fs_guard import user_tree
from agent.repair.failure import Failure
from agent.repair.rules.rule import Kind, RepairContext, Rule, message_facts, report


OOM_PATTERNS = re.compile(
    r"(MemoryError|out of memory|OutOfMemoryError|CUDA out of memory|NPU out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory(?! in static TLS)|std::bad_alloc)", re.I)


OUT_OF_MEMORY = "out_of_memory"


# Where a bare Python MemoryError (not torch's OutOfMemoryError / allocator messages) is the *model's*: raised
# inside the model's run (torch, transformers, safetensors, the engine's model code, the recipe's models/).
# Raised anywhere else (a YAML or JSON loader, tokenizer files, copy/json of settings, an archive) it is the
# input's size, not the model's memory: not this rule, never the memory estimate (exit 6).
_MODEL_FRAMES = re.compile(r"(/torch/|/torch_npu/|/transformers/|/safetensors/|/accelerate/|/engine/(model_runner|generate|"
                           r"loading|parallel|device_ops|graph_mode|backends/)|/models/)")
_BARE_MEMORY_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?MemoryError\b")


def _oom_facts(failure: Failure, found: re.Match) -> dict | None:
    if found.group(0) != "MemoryError":
        return {"message": found.group(0)}
    from agent.child_failure import tracebacks

    raised = [frames for frames, error, _link in tracebacks(failure.output) if _BARE_MEMORY_ERROR.match(error)]
    if not raised:
        return {"message": found.group(0)} if not failure.frames else None
    innermost = raised[0][-1][0] if raised[0] else ""
    if _MODEL_FRAMES.search(innermost.replace("\\", "/")):
        return {"message": found.group(0)}
    return None


def _fix_oom(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    return f"the run ran out of memory ({facts['message']}): see the memory estimate"


def _timeout_facts(failure: Failure, found: re.Match | None) -> dict:
    lines = [ln.strip() for ln in failure.output.strip().splitlines() if ln.strip()]
    settings = failure.settings()
    data = settings.get("data_config") or {}
    return {"last_line": lines[-1][-300:] if lines else "(no output)",
            "max_new_tokens": data.get("max_new_tokens"), "world_size": settings.get("world_size")}


def _fix_timeout(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # Report only: a hang has no safe automatic fix (the cause may be a collective, an input
    # wait or simply a slow device); the note says where it stopped and what to change.
    return (f"infer.sh ran past --timeout {ctx.timeout_s}s; its last output line was: {facts['last_line']!r}. "
            f"If it was still generating, raise --timeout or lower data_config.max_new_tokens "
            f"({facts['max_new_tokens']}); if it was waiting (world_size {facts['world_size']}: every rank "
            f"must start; or input/collective), fix that wait")


# ---- missing pip package --------------------------------------------------------------
# import name -> distribution name on PyPI, where they differ (or are often confused).
IMPORT_TO_DIST = {
    "yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow", "cv2": "opencv-python",
    "google.protobuf": "protobuf", "skimage": "scikit-image", "bs4": "beautifulsoup4",
    "attr": "attrs", "dateutil": "python-dateutil", "Crypto": "pycryptodome", "jwt": "PyJWT",
    "dotenv": "python-dotenv", "fitz": "PyMuPDF", "docx": "python-docx", "Levenshtein": "levenshtein",
    "sentencepiece": "sentencepiece", "einops": "einops", "tiktoken": "tiktoken", "timm": "timm",
    "flash_attn": "flash-attn", "jieba": "jieba", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "accelerate": "accelerate", "scipy": "scipy", "numpy": "numpy", "pandas": "pandas",
    "transformers_stream_generator": "transformers-stream-generator", "triton": "triton",
    "torchvision": "torchvision", "torchaudio": "torchaudio", "soundfile": "soundfile",
    "librosa": "librosa", "decord": "decord", "av": "av", "msgpack": "msgpack", "regex": "regex",
    "blobfile": "blobfile", "zmq": "pyzmq", "google.generativeai": "google-generativeai",
}


_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


_RECIPE_MODULES = {"models", "engine", "agent"}    # the recipe's own and infer-migrator's packages


def pip_distribution(module: str) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        dist = IMPORT_TO_DIST.get(".".join(parts[:i]))
        if dist:
            return dist
    return parts[0]


def install_command(dist: str) -> str:
    return f"{sys.executable} -m pip install {shlex.quote(dist)}"


def _missing_package_facts(failure: Failure, found: re.Match) -> dict | None:
    module = found.group(1)
    top = module.split(".")[0]
    recipe = failure.recipe_dir
    if top in _RECIPE_MODULES or top.startswith("runner_") or (recipe / f"{top}.py").exists() \
            or (recipe / top).is_dir():
        return None           # a recipe-local module: a layout problem, not a package to install
    if importlib.util.find_spec(top) is not None:
        return None           # the package is there, a submodule is not: a version problem
    dist = pip_distribution(module)
    return {"module": module, "distribution": dist, "install": install_command(dist)}


def _fix_missing_package(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if not ctx.allow_install:
        return (f"module {facts['module']} is not installed; install it with `{facts['install']}` "
                f"(or re-run with --allow-install); nothing changed")
    # The recipe records its dependencies: a line of its requirements.txt for it is what gets installed.
    requirements = failure.recipe_dir / "requirements.txt"
    listed = requirements.read_text() if requirements.is_file() else ""
    lines = {re.split(r"[<>=!~\[;\s]", ln.strip(), maxsplit=1)[0].lower().replace("_", "-"): ln.split("#")[0].strip()
             for ln in listed.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    pinned = lines.get(facts["distribution"].lower().replace("_", "-"))
    spec = pinned or facts["distribution"]
    install = install_command(spec)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", spec],
                          capture_output=True, text=True, timeout=ctx.timeout_s)
    if proc.returncode != 0:
        return f"`{install}` failed: {child_failure(proc.stderr, proc.returncode, stdout=proc.stdout)}"
    if pinned:
        return f"ran `{install}` (as the recipe's requirements.txt pins it)"
    user_tree(failure.recipe_dir).write_text(requirements, listed + ("" if not listed or listed.endswith("\n") else "\n")
                                             + f"{facts['distribution']}\n")

    return f"ran `{install}`; added {facts['distribution']} to requirements.txt"


# ---- the SentencePiece / tiktoken / protobuf backend of a tokenizer is missing -------------
_TOKENIZER_BACKEND = re.compile(r"(\w+) requires the (SentencePiece|protobuf|tiktoken|Tokenizers) library but it "
                                r"was not found in your environment")


_BACKEND_DIST = {"SentencePiece": "sentencepiece", "protobuf": "protobuf", "tiktoken": "tiktoken",
                 "Tokenizers": "tokenizers"}


def _tokenizer_backend_facts(failure: Failure, found: re.Match) -> dict | None:
    dist = _BACKEND_DIST[found.group(2)]
    return {"module": dist, "distribution": dist, "install": install_command(dist), "class": found.group(1)}


_NPU_BLOCKED = "import of torch_npu halted; None in sys.modules"


# ---- torch_npu imported from its (unbuilt) source tree -------------------------------------
_NPU_SOURCE_TREE = re.compile(r"No module named 'torch_npu\._C'|" + re.escape(_NPU_BLOCKED))


def torch_npu_package_dir(recipe_dir: Path) -> Path | None:
    """The torch_npu package folder a run of the recipe imports (infer.sh puts the recipe first on
    PYTHONPATH, then the caller's PYTHONPATH, then the interpreter's path), or None."""
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


# ---- safetensors shards that are not safetensors ------------------------------------------
_SAFETENSORS = re.compile(r"SafetensorError: Error while deserializing header: (HeaderTooLarge|header too large|"
                          r"InvalidHeaderDeserialization|MetadataIncompleteBuffer)")


def _safetensors_facts(failure: Failure, found: re.Match) -> dict | None:
    model_path = Path(str(failure.settings().get("model_path") or ""))
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


# The advice-only rules: name | evidence (a regex, searched in the error line, then the output) | diagnosis |
# advice, a template of {where}, {message} and the evidence's named groups | facts (None: message_facts).
# Their fix changes nothing: the repair loop stops with the advice instead of "unknown failure".
ADVICE = (
    ("torch_npu_imported_from_source_tree",
     _NPU_SOURCE_TREE,
     "torch_npu is imported from its own source tree (torch_npu._C is missing)",
     "`import torch_npu` picked up the torch_npu source directory instead of the installed package "
     "({where}): run infer.sh from a directory that is not the torch_npu source tree",
     _source_tree_facts),
    ("torch_npu_backend_autoload_failed",
     r"Failed to load the backend extension: torch_npu",
     "torch_npu is installed but cannot load, so `import torch` itself fails (backend autoload)",
     "torch >= 2.5 auto-loads torch_npu at `import torch` and that failed ({where}): on a host without "
     "CANN run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or uninstall torch_npu); on an NPU host source "
     "/usr/local/Ascend/ascend-toolkit/set_env.sh and install the torch_npu built for this torch",
     None),
    ("torch_npu_without_cann",
     r"(?P<lib>lib(?:hccl|ascend_hal|ascendcl|atb|acl_op_compiler|ge_runner|"
     r"runtime)\.so)\S*: cannot open shared object file",
     "torch_npu cannot load the CANN runtime libraries (CANN not installed or set_env.sh not sourced)",
     "{lib} is missing ({where}): source /usr/local/Ascend/ascend-toolkit/set_env.sh (and the driver's "
     "LD_LIBRARY_PATH) before infer.sh, or run on CPU/CUDA without torch_npu installed",
     None),
    ("shell_script_not_executable",
     r"(?P<script>\S+\.sh): Permission denied",
     "a recipe script is run as ./script but is not executable",
     "{script} is not executable: run it as `bash {script}` (what migrator does) or chmod +x it",
     None),
    ("npu_device_id_invalid",
     r"invalid device=\d+, input visible devices:[\d,]*|"
     r"open device \d+ failed, runtime result = 107001|Invalid device (?:ID|id)|"
     r"SetDevice\(device_id_\), error code is 507033",
     "the NPU id a rank asks for is not visible (ASCEND_RT_VISIBLE_DEVICES / world_size)",
     "{message}: ranks are numbered from 0 within ASCEND_RT_VISIBLE_DEVICES; list ascending, existing "
     "ids (see npu-smi info) and keep world_size <= their count",
     None),
    ("npu_device_busy",
     r"because the device is used\. ret is -8020|Maybe the last training process is running|"
     r"dcmi module initialize failed\. ret is -8005",
     "the NPU is held by another process",
     "{message}: another process holds the NPU: check `npu-smi info` for running processes, stop them "
     "and wait ~10 s, or pick a free device with ASCEND_RT_VISIBLE_DEVICES",
     None),
    ("cann_runtime_init_failed",
     r"EH9999[^\n]*\n?[^\n]*init env failed|ERR00100 PTA call acl api failed|Inner Error!\s*\n?\s*EH9999",
     "the CANN runtime failed to initialise (driver / dependencies)",
     "{message}: the CANN runtime could not start: check the driver with `npu-smi info`, that the CANN "
     "version matches the driver, and CANN's Python dependencies (decorator, sympy, cffi, protobuf, "
     "attrs, psutil, scipy)",
     None),
    ("hccl_init_failed",
     r"HcclCommInitRootInfo[^\n]*|HcclCommInitRootConfig[^\n]*|ERR02200 DIST call hccl api failed",
     "HCCL could not create the communicator between ranks",
     "{message}: the ranks could not form an HCCL group: every rank must start (world_size), see the "
     "same MASTER_ADDR/MASTER_PORT, and use distinct NPUs; check the device network with "
     "hccn_tool / the HCCL test",
     None),
    ("hccl_collective_timeout",
     r"EI0006[^\n]*|Getting socket times out|Watchdog caught collective operation timeout[^\n]*|"
     r"HcclAllreduce, error code is \d+",
     "a collective timed out: some rank did not take part in time",
     "{message}: a rank is stuck or dead: look at every rank's log for an earlier error, make every "
     "rank run the same number of generate steps, raise HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT only "
     "if the ranks are merely slow",
     None),
    ("npu_api_version_mismatch",
     r"module 'torch_npu(?:\.npu)?' has no attribute '(?P<api>(?!npu_|_npu)\w+)'",
     "the recipe calls a torch_npu API the installed torch_npu does not have",
     "torch_npu has no {api} ({where}): the recipe was written for another torch_npu release; install "
     "the torch_npu that matches the recipe's (see requirements.txt) or use that release's API name",
     None),
    ("static_tls_libgomp",
     r"(?P<lib>\S*libgomp\S*): cannot allocate memory in static TLS block",
     "libgomp cannot be loaded after other libraries (static TLS exhausted)",
     "{lib} cannot be loaded late: export LD_PRELOAD={lib} before infer.sh",
     None),
    ("shared_library_missing",
     r"(?P<lib>lib[\w.+-]+\.so[\d.]*): cannot open shared object file",
     "a native library a Python package needs is missing",
     "{lib} is not found ({where}): install the system package providing it or add its directory "
     "to LD_LIBRARY_PATH",
     None),
    ("transformers_does_not_know_model",
     r"model type `(?P<model_type>[\w-]+)` but Transformers does not recognize this architecture",
     "the installed transformers does not know the checkpoint's model type",
     "model type {model_type} is unknown to the installed transformers: upgrade transformers, or if "
     "the checkpoint ships its own modeling code re-run with --trust-remote-code after reviewing it",
     None),
    ("tokenizer_class_unknown",
     r"Tokenizer class (?P<cls>\w+) does not exist or is not currently imported",
     "tokenizer_config.json names a tokenizer class transformers does not have",
     "tokenizer class {cls} is unknown: fix tokenizer_class in the checkpoint's tokenizer_config.json "
     "(e.g. LLaMATokenizer -> LlamaTokenizer) or install the transformers version it was saved with",
     None),
    ("transformers_api_moved",
     r"cannot import name '(?P<name>\w+)' from '(?P<module>transformers[\w.]*)'|"
     r"No module named '(?P<submodule>transformers\.[\w.]+)'",
     "vendored code imports a transformers name this version does not have",
     "{where}: the vendored code was written for another transformers release ({message}); pin the "
     "transformers version in requirements.txt or update the import to its new location",
     None),
    ("safetensors_header_invalid",
     _SAFETENSORS,
     "a safetensors shard is not a valid safetensors file",
     "SafetensorError {error}: {why}",
     _safetensors_facts),
    ("checkpoint_shape_mismatch",
     _SHAPE_MISMATCH,
     "checkpoint tensors have other shapes than the model built from the config",
     "{param}: checkpoint {ckpt} vs model {model}: config.json (vocab_size / hidden sizes) does not "
     "describe these weights; use the config that was saved with the checkpoint",
     _shape_facts),
    ("meta_tensor_not_loaded",
     r"Cannot copy out of meta tensor; no data!",
     "parameters stayed on the meta device (never loaded) and are then moved",
     "{where}: some weights were never materialised (meta device): their keys are missing from the "
     "checkpoint or device_map offloaded them; do not call .to()/.cuda() on a device_map model",
     None),
    ("non_finite_logits",
     r"probability tensor contains either `?inf`?, `?nan`? or element < 0",
     "sampling got inf/nan probabilities (numerical overflow)",
     "{where}: the logits are inf/nan: float16 overflows on many models: use model_config.dtype "
     "bfloat16 or float32, and check the weights loaded (no missing keys)",
     None),
    ("process_group_not_initialized",
     r"Default process group has not been initialized, please make sure to call init_process_group",
     "a torch.distributed call ran without an initialised process group",
     "{where}: torch.distributed is used but no process group exists: launch through infer.sh "
     "(engine.launch starts torchrun when world_size > 1) or guard the call with "
     "torch.distributed.is_initialized()",
     None),
    ("rendezvous_port_in_use",
     r"(?:EADDRINUSE|errno: 98 - Address already in use|Address already in use)[^\n]*",
     "the torchrun rendezvous port is taken by another run",
     "{message}: another job holds the master port: stop it or export MASTER_PORT=<free port> "
     "before infer.sh",
     None),
)


def advice_rules(table=ADVICE) -> list[Rule]:
    return [Rule(name, re.compile(evidence) if isinstance(evidence, str) else evidence, diagnosis, report(advice),
                 facts=facts or message_facts, kind=Kind.REPORT)
            for name, evidence, diagnosis, advice, facts in table]


RULES: list[Rule] = [
    Rule(OUT_OF_MEMORY, OOM_PATTERNS, "out of memory", _fix_oom,
         facts=_oom_facts, where=("output",), kind=Kind.REPORT),
    Rule("run_timed_out", re.compile(r"^TimeoutError: infer\.sh did not finish"), "infer.sh hangs or runs past the timeout",
         _fix_timeout, facts=_timeout_facts, where=("error",), kind=Kind.REPORT),
    Rule("missing_pip_package", _NO_MODULE,
         "a Python package the recipe imports is not installed (install it, or re-run with --allow-install)",
         _fix_missing_package, facts=_missing_package_facts, where=("error",), kind=Kind.REPORT, installs=True),
    Rule("tokenizer_backend_missing", _TOKENIZER_BACKEND,
         "the tokenizer needs a library (SentencePiece, protobuf, tiktoken) not installed",
         _fix_missing_package,
         facts=_tokenizer_backend_facts, kind=Kind.REPORT, installs=True),
    *advice_rules(),
]
