"""Rules whose fix is a codemod on the recipe's Python files (agent/codemods/commands/), never a
regeneration: vendored modeling, runner, infer.py, imports, devices."""

from __future__ import annotations

import re
from pathlib import Path

import libcst as cst
from libcst.codemod import CodemodContext

from agent.codemods.commands.add_forward_kwargs import AddForwardKwargsCommand
from agent.codemods.commands.add_process_weights_after_loading import AddProcessWeightsAfterLoadingCommand
from agent.codemods.commands.cuda_calls_to_device_ops import CudaCallsToDeviceOpsCommand
from agent.codemods.commands.decode_attention_mask import DecodeAttentionMaskCommand
from agent.codemods.commands.device_agnostic_cuda import DeviceAgnosticCudaCommand
from agent.codemods.commands.guard_optional_import import GUARD_FLASH_ATTN, GUARD_TORCHAIR, GuardOptionalImportCommand
from agent.codemods.commands.insert_warm_up import InsertWarmUpCommand, generate_calls, warm_up_argument
from agent.codemods.commands.npu_calls_to_device_ops import NpuCallsToDeviceOpsCommand
from agent.codemods.commands.npu_device_string import NpuDeviceStringCommand
from agent.codemods.commands.npu_tensor_method import NpuTensorMethodCommand
from agent.codemods.commands.pad_token_fallback import PadTokenFallbackCommand
from agent.codemods.commands.per_rank_batch_size import PerRankBatchSizeCommand
from agent.codemods.commands.rope_scaling_type_key import RopeScalingTypeKeyCommand
from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.codemods.commands.trust_remote_code import TrustRemoteCodeCommand
from agent.codemods.driver import command, rewrite_file, would_rewrite
from agent.recipe.recipe import runner_files
from agent.repair.failure import Failure
from agent.repair.rules._util import edit_yaml_line
from agent.repair.rules.rule import Kind, RepairContext, Rule, where_it_failed


GUARD_FLASH_ATTN_IMPORTS = command(GuardOptionalImportCommand, **GUARD_FLASH_ATTN)


# ---- helpers -----------------------------------------------------------------------------
def _defining_file(recipe_dir: Path, class_name: str) -> Path | None:
    """The recipe file (models/ first, then the top level) with a module-level `class class_name`."""
    pattern = re.compile(rf"^class {re.escape(class_name)}\b", re.M)
    files = sorted((recipe_dir / "models").rglob("*.py")) + sorted(recipe_dir.glob("*.py"))
    return next((p for p in files if pattern.search(p.read_text(errors="replace"))), None)


def _rel(recipe_dir: Path, path: Path) -> str:
    return str(path.relative_to(recipe_dir))


def _files_it_changes(failure: Failure, commands, mentioning: str, files: list[Path] | None = None) -> list[str]:
    """The recipe's Python files (default: all of them) that mention `mentioning` and that the
    commands would change, recipe-relative."""
    return [_rel(failure.recipe_dir, p) for p in (files if files is not None else failure.recipe.code_files())
            if mentioning in p.read_text(errors="replace") and would_rewrite(p, commands)]


def _rewrite_each(failure: Failure, files: list[str], commands) -> None:
    for rel in files:
        rewrite_file(failure.recipe_dir / rel, commands, root=failure.recipe_dir)


# ---- model __init__ without runner_settings ----------------------------------------------
_INIT_RUNNER_SETTINGS = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument 'runner_settings'")


def _runner_settings_facts(failure: Failure, found: re.Match) -> dict | None:
    path = _defining_file(failure.recipe_dir, found.group(1))
    if path is None or not would_rewrite(path, [RunnerSettingsInitCommand]):
        return None
    return {"class": found.group(1), "file": _rel(failure.recipe_dir, path)}


def _fix_runner_settings(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"], [RunnerSettingsInitCommand], root=failure.recipe_dir)
    return f"RunnerSettingsInitCommand on {facts['file']}: model __init__ accepts runner_settings=None, **kwargs"


# ---- forward() without **kwargs -------------------------------------------------------
_FORWARD_KWARG = re.compile(r"(\w+)\.(forward)\(\) got an unexpected keyword argument '(\w+)'")


def _forward_kwarg_facts(failure: Failure, found: re.Match) -> dict | None:
    cls, method, kwarg = found.groups()
    path = _defining_file(failure.recipe_dir, cls)
    if path is None or not would_rewrite(path, [command(AddForwardKwargsCommand, class_name=cls, method=method)]):
        return None
    return {"class": cls, "method": method, "kwarg": kwarg, "file": _rel(failure.recipe_dir, path)}


def _fix_forward_kwarg(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"],
                 [command(AddForwardKwargsCommand, class_name=facts["class"], method=facts["method"])],
                 root=failure.recipe_dir)
    return (f"added **kwargs to {facts['class']}.{facts['method']} in {facts['file']} "
            f"(it was called with {facts['kwarg']}=...)")


# ---- flash_attn not installed ---------------------------------------------------------
_NO_FLASH_ATTN = re.compile(r"No module named '(flash_attn[\w.]*)'|package flash_attn seems to be not installed|"
                            r"FlashAttention2 has been toggled on, but it cannot be used")


def _flash_attn_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_it_changes(failure, [GUARD_FLASH_ATTN_IMPORTS], "flash_attn")
    attn = (failure.settings().get("model_config") or {}).get("attn_implementation")
    yaml_needs_change = isinstance(attn, str) and attn.startswith("flash_attention")
    if not files and not yaml_needs_change:
        return None
    return {"files": files, "attn_implementation": attn, "set_sdpa": yaml_needs_change}


def _fix_flash_attn(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    notes = []
    _rewrite_each(failure, facts["files"], [GUARD_FLASH_ATTN_IMPORTS])
    notes += [f"guarded flash_attn imports in {rel}" for rel in facts["files"]]
    if facts.get("set_sdpa"):
        notes.append(edit_yaml_line(failure.yaml, "model_config", "attn_implementation", "sdpa",
                                     root=failure.recipe_dir))
    return "; ".join(notes)


# ---- hard-coded CUDA ------------------------------------------------------------------
_NO_CUDA = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available|"
    r"CUDA driver initialization failed|CUDA is not available|torch\.cuda\.is_available\(\) is False|"
    r"Expected all tensors to be on the same device|no CUDA-capable device|Invalid device string: 'cuda", re.I)


def _cuda_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_it_changes(failure, [DeviceAgnosticCudaCommand], "cuda")
    return {"files": files} if files else None


def _fix_cuda(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    _rewrite_each(failure, facts["files"], [DeviceAgnosticCudaCommand])
    return f"DeviceAgnosticCudaCommand on {', '.join(facts['files'])}: hard-coded CUDA replaced by the recipe device"


# ---- remote code needs trust_remote_code -----------------------------------------------
_REMOTE_CODE = re.compile(r"contains custom code which must be executed|requires you to execute the "
                          r"\w+ file in that repo")


def _remote_code_facts(failure: Failure, found: re.Match) -> dict | None:
    # The innermost frame in the recipe's own code whose line calls from_pretrained.
    for rel, line in reversed(failure.recipe_frames()):
        path = failure.recipe_dir / rel
        if would_rewrite(path, [command(TrustRemoteCodeCommand, line=line)]):
            return {"file": rel, "line": line}
    return None


def _fix_remote_code(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if not ctx.trust_remote_code:
        return (f"{facts['file']}:{facts['line']} loads a checkpoint with custom code: re-run with "
                f"--trust-remote-code after reviewing the code; nothing changed")
    rewrite_file(failure.recipe_dir / facts["file"], [command(TrustRemoteCodeCommand, line=facts["line"])],
                 root=failure.recipe_dir)
    return f"added trust_remote_code=True to the from_pretrained call at {facts['file']}:{facts['line']}"


# ---- tokenizer without pad token ------------------------------------------------------
_NO_PAD = re.compile(r"Asking to pad but the tokenizer does not have a padding token")


def _pad_token_facts(failure: Failure, found: re.Match) -> dict | None:
    recipe = failure.recipe_dir
    candidates = list(dict.fromkeys(runner_files(recipe) + sorted(recipe.glob("*.py"))))
    files = _files_it_changes(failure, [PadTokenFallbackCommand], "from_pretrained", candidates)
    return {"files": files} if files else None


def _fix_pad_token(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    _rewrite_each(failure, facts["files"], [PadTokenFallbackCommand])
    return f"pad token falls back to EOS after the tokenizer is loaded in {', '.join(facts['files'])}"


# ---- incidental NPU calls on a host without torch_npu -------------------------------------
# NPU kernels and private ops: nothing portable stands in for them (exit 4 before any repair).
NPU_KERNEL_RE = re.compile(r"\btorch_npu\.(?:npu_\w+|_npu_\w+|_C\b)|\btorch\.ops\.npu\b|"
                           r"\btorch_npu\.contrib\.(?!transfer_to_npu)\w+")


# In the order a fix applies them: calls and handles first, then the import they needed.
NPU_COMMANDS = (NpuCallsToDeviceOpsCommand, NpuTensorMethodCommand, NpuDeviceStringCommand, TorchNpuImportGuardCommand,
                command(GuardOptionalImportCommand, **GUARD_TORCHAIR))


CUDA_COMMANDS = (CudaCallsToDeviceOpsCommand,)


def npu_kernel_uses(source: str) -> list[str]:
    """The NPU kernels / private ops a source calls (sorted, unique)."""
    return sorted(set(NPU_KERNEL_RE.findall(source)))


# "import of torch_npu halted": torch_npu is installed but cannot load (no CANN, a broken build);
# engine.environment's probe imported it once, saw it fail and blocked it (None in sys.modules) so
# that torch and transformers run without it; the recipe's own `import torch_npu` then says only this.
_NPU_MISSING = re.compile(
    r"module 'torch' has no attribute 'npu'|No module named 'torch_npu'|No module named 'torchair'|"
    r"object has no attribute 'npu'|"
    r"device type at start of device string: npu|Failed to import torch_npu|"
    r"import of torch_npu halted; None in sys\.modules|"
    r"(?:libhccl|libascend_hal|libascendcl)\.so: cannot open shared object file")


def _incidental_npu_facts(failure: Failure, found: re.Match) -> dict | None:
    files, kernels = [], []
    for path in failure.recipe.code_files():
        text = path.read_text(errors="replace")
        kernels += npu_kernel_uses(text)
        if ("npu" in text or "torchair" in text) and would_rewrite(path, NPU_COMMANDS):
            files.append(str(path.relative_to(failure.recipe_dir)))
    if kernels or not files:
        return None         # kernels: no portable equivalent (exit 4); nothing incidental: not ours
    return {"files": files}


def _fix_incidental_npu(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    _rewrite_each(failure, facts["files"], NPU_COMMANDS)
    return (f"incidental NPU calls in {', '.join(facts['files'])} now go through engine.device_ops "
            "(NPU behaviour kept on an NPU; CUDA and CPU run too)")


# ---- incidental CUDA calls on a host without CUDA ----------------------------------------
_CUDA_MISSING = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available|"
    r"CUDA driver initialization failed|module 'torch\._C' has no attribute '_cuda_\w+'|no CUDA-capable device")


def _incidental_cuda_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_it_changes(failure, CUDA_COMMANDS, "torch.cuda.")
    return {"files": files} if files else None


def _fix_incidental_cuda(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    _rewrite_each(failure, facts["files"], CUDA_COMMANDS)
    return f"torch.cuda bookkeeping calls in {', '.join(facts['files'])} now go through engine.device_ops"


# ---- vendored code reads an old rope_scaling schema --------------------------------------
_ROPE = re.compile(r"KeyError: '(type|rope_type|factor|original_max_position_embeddings)'|`rope_scaling` must be a "
                   r"dictionary with (?:with )?two fields|Unknown RoPE scaling type (\w+)")


def _rope_facts(failure: Failure, found: re.Match) -> dict | None:
    if found.group(1) and "rope" not in failure.output:
        return None
    key = found.group(1) or found.group(2) or "type/factor"
    files = []
    if key == "type":
        files = _files_it_changes(failure, [RopeScalingTypeKeyCommand], "rope_scaling")
    return {"key": key, "where": where_it_failed(failure), "files": files}


def _fix_rope(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if facts["files"]:
        _rewrite_each(failure, facts["files"], [RopeScalingTypeKeyCommand])
        return (f"rope_scaling['type'] now reads .get('type', .get('rope_type')) in {', '.join(facts['files'])} "
                "(transformers >= 4.45 renamed the key)")
    return (f"rope_scaling key {facts['key']!r} at {facts['where']}: transformers >= 4.45 stores "
            "rope_scaling['rope_type'] (was 'type') and fills defaults; read it with .get(...) in the vendored "
            "code, or pin the transformers release the code was written for")


# ---- infer.py without a warm-up generation ------------------------------------------------
_NO_WARM_UP = re.compile(re.escape("BaselineError: infer.py ran without a warm-up generation"))


def _no_warm_up_facts(failure: Failure, found: re.Match) -> dict | None:
    infer_py = failure.recipe_dir / "infer.py"
    if not infer_py.is_file():
        return None
    try:
        module = cst.parse_module(infer_py.read_text())
    except cst.ParserSyntaxError:
        return None
    calls = generate_calls(module)
    if any(warm_up_argument(c) for c in calls):
        return None          # a warm-up is there but did not run: not this rule's fix
    formal = next((c for c in calls if c.args), None)
    return {"file": "infer.py", "call": module.code_for_node(formal)} if formal is not None else None


def _fix_no_warm_up(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    context = CodemodContext()
    if not rewrite_file(failure.recipe_dir / facts["file"], [InsertWarmUpCommand], context=context,
                        root=failure.recipe_dir):
        return f"{facts['file']}: no formal model_generate call to put a warm-up before"
    return f"{facts['file']}: inserted `{context.scratch['inserted']}` before the formal generation"


# ---- upstream's common issues (cann-recipes-infer's model-infer-migrator skill,
# references/common_issues.md; issue 1 is models_init_shadows_package, issue 3 infer.sh's
# infer_sh_without_repository_root in agent.repair.rules.files) ------------------------------
_UPSTREAM_WHERE = ("error", "output", "log")


def _codemod_fix(commands, what: str):
    def fix(failure: Failure, facts: dict, ctx: RepairContext) -> str:
        _rewrite_each(failure, facts["files"], commands)
        return f"{what} in {', '.join(facts['files'])}"
    return fix


# 2. the decode step keeps the prefill causal mask (`forward_metadata.attention_mask`):
# aclnnFusedInferAttentionScoreV3 rejects `batchSize[2048] of atten_mask != batchSize[1] of query`.
_DECODE_MASK = re.compile(r"batchSize\[\d+\] of atten_mask != batchSize\[\d+\] of query")


def _decode_mask_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_it_changes(failure, [DecodeAttentionMaskCommand], "attention_mask")
    return {"files": files} if files else None


# 4. a MoE / quantized model class without `process_weights_after_loading`: the framework skips the
# weight repacking and aclnnGroupedMatmul reports `Dim 1 mismatch`.
_GROUPED_MATMUL = re.compile(r"aclnnGroupedMatmul\S*.*Dim 1 mismatch|GroupedMatmul.*[Dd]im 1 mismatch"
                             r"|(?P<matmul>mat1 and mat2 shapes cannot be multiplied)")
# ... or, before any MoE layer, the first linear layer: upstream's UnquantizedLinearMethod.apply multiplies by
# the weight its process_weights_after_loading transposes (module/linear.py), so a model without the hook
# stops at `torch.matmul(x, layer.weight.data)` (off an NPU the stand-in's run shows it first)
_HOOK_DEF = "def process_weights_after_loading"
_MODEL_CLASS = re.compile(r"^class (\w+ForCausalLM)\b", re.M)


def _process_weights_facts(failure: Failure, found: re.Match) -> dict | None:
    if found.group("matmul"):
        # only where the shape error is in a layer method whose weights the hook prepares
        files = {Path(file) for file, _ in failure.frames[-3:]}
        if not any(path.is_file() and _HOOK_DEF in path.read_text(errors="replace") for path in files):
            return None
    for path in failure.recipe.code_files():
        for name in _MODEL_CLASS.findall(path.read_text(errors="replace")):
            if would_rewrite(path, [command(AddProcessWeightsAfterLoadingCommand, class_name=name)]):
                return {"file": _rel(failure.recipe_dir, path), "class": name}
    return None


def _fix_process_weights(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"],
                 [command(AddProcessWeightsAfterLoadingCommand, class_name=facts["class"])], root=failure.recipe_dir)
    return (f"{facts['class']} ({facts['file']}) has process_weights_after_loading: the framework now repacks "
            "MoE / quantized weights after loading")


# 5. per-rank MoE buffers sized by the global `scheduler_config.batch_size` instead of
# `batch_size_per_dp_rank`: aclnnMoeInitRouting reports `row_idx shape mismatch` (graph mode).
_ROW_IDX = re.compile(r"aclnnMoeInitRouting\S*.*row_idx shape mismatch|MoeInitRouting.*row_idx.*mismatch")


def _per_rank_facts(failure: Failure, found: re.Match) -> dict | None:
    files = _files_it_changes(failure, [PerRankBatchSizeCommand], "scheduler_config")
    return {"files": files} if files else None


RULES: list[Rule] = [
    Rule("constructor_without_runner_settings", _INIT_RUNNER_SETTINGS,
         "a vendored model __init__ does not accept the runner_settings the engine passes",
         _fix_runner_settings, facts=_runner_settings_facts, kind=Kind.CODEMOD),
    Rule("forward_unexpected_keyword", _FORWARD_KWARG,
         "a model forward() gets a keyword argument its signature does not accept",
         _fix_forward_kwarg, facts=_forward_kwarg_facts, kind=Kind.CODEMOD),
    Rule("flash_attn_not_installed", _NO_FLASH_ATTN, "recipe code needs flash_attn, which is not installed",
         _fix_flash_attn, facts=_flash_attn_facts, kind=Kind.CODEMOD),
    Rule("hardcoded_cuda_device", _NO_CUDA, "recipe code hard-codes CUDA, which this device does not have",
         _fix_cuda, facts=_cuda_facts, kind=Kind.CODEMOD),
    Rule("remote_code_needs_trust", _REMOTE_CODE,
         "a from_pretrained call loads a checkpoint with custom code (re-run with --trust-remote-code "
         "after reviewing the code)",
         _fix_remote_code, facts=_remote_code_facts, kind=Kind.CODEMOD),
    Rule("tokenizer_without_pad_token", _NO_PAD, "the tokenizer has no padding token but the batch needs padding",
         _fix_pad_token, facts=_pad_token_facts, kind=Kind.CODEMOD),
    Rule("incidental_npu_call", _NPU_MISSING,
         "recipe code makes NPU bookkeeping calls (torch.npu.*, .npu(), device=\"npu\", import torch_npu) on a "
         "host without torch_npu",
         _fix_incidental_npu,
         facts=_incidental_npu_facts, kind=Kind.CODEMOD),
    Rule("incidental_cuda_call", _CUDA_MISSING,
         "recipe code makes CUDA bookkeeping calls (torch.cuda.set_device, Event, memory stats...) without CUDA",
         _fix_incidental_cuda,
         facts=_incidental_cuda_facts, kind=Kind.CODEMOD),
    Rule("rope_scaling_schema", _ROPE,
         "vendored code and config disagree on the rope_scaling schema",
         _fix_rope,
         facts=_rope_facts, kind=Kind.CODEMOD),
    Rule("infer_py_without_warm_up", _NO_WARM_UP,
         "infer.py runs the formal generation without a warm-up generation first",
         _fix_no_warm_up, facts=_no_warm_up_facts, where=("output",), kind=Kind.CODEMOD),
    Rule("decode_keeps_prefill_attention_mask", _DECODE_MASK,
         "the decode step passes the prefill causal mask to the attention kernel (upstream common issue 2)",
         _codemod_fix([DecodeAttentionMaskCommand], "the attention mask is forward_metadata.attention_mask at "
                                                    "prefill only (None at decode)"),
         facts=_decode_mask_facts, where=_UPSTREAM_WHERE, kind=Kind.CODEMOD),
    Rule("process_weights_after_loading_missing", _GROUPED_MATMUL,
         "the model class lacks process_weights_after_loading, so MoE / quantized weights are not repacked "
         "(upstream common issue 4)",
         _fix_process_weights, facts=_process_weights_facts, where=_UPSTREAM_WHERE, kind=Kind.CODEMOD),
    Rule("per_rank_buffers_sized_by_global_batch", _ROW_IDX,
         "per-rank MoE buffers are sized by the global batch_size, not batch_size_per_dp_rank "
         "(upstream common issue 5)",
         _codemod_fix([PerRankBatchSizeCommand], "per-rank buffers use scheduler_config.batch_size_per_dp_rank"),
         facts=_per_rank_facts, where=_UPSTREAM_WHERE, kind=Kind.CODEMOD),
]
