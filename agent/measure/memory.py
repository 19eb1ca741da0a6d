"""Memory estimate per rank: weight bytes from checkpoint headers (no tensor loaded) + KV cache bytes,
for 1, 2, 4, 8, 16 tensor-parallel ranks against one card's memory."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from agent.child_failure import child_failure
from agent.errors import InputError
from agent.records import MemoryEstimate
from agent.recipe.parallel import plan_patterns
from agent.recipe.recipe import Recipe, RunPlan
from engine import defaults
from engine.environment import Environment
from engine.environment import simulated_card_bytes as parse_card_bytes
from engine.safe_load import load_json, loads_json

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
# The tensors a run casts to its dtype; quantized data (int8 / packed int32 / fp8 / fp4 blocks, e8m0 scales)
# stays as published, so it counts the bytes the checkpoint holds.
RUN_DTYPE_FLOATS = ("F64", "F32", "F16", "BF16")
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TP_SIZES = (1, 2, 4, 8, 16)


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return loads_json(f.read(length))


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[int, str]]:
    """name -> (numel, safetensors dtype name) over *.safetensors headers, or else the *.bin files
    (loaded on the meta device: shapes and dtypes only, no data read)."""
    model_dir = Path(model_dir)
    tensors: dict[str, tuple[int, str]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        for key, meta in safetensors_header(file).items():
            if key != "__metadata__":
                tensors[key] = (math.prod(meta["shape"]) if meta["shape"] else 1, meta["dtype"])
    if files:
        return tensors
    import torch

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
    for file in sorted(model_dir.glob("*.bin")):
        state = torch.load(file, map_location="meta", weights_only=True)
        for key, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                tensors[key] = (tensor.numel(), names.get(tensor.dtype, "F32"))
    return tensors


def _tensor_bytes(numel: int, dtype_name: str, dtype: str | None) -> int:
    floating = dtype_name in RUN_DTYPE_FLOATS
    size = TORCH_DTYPE_BYTES[dtype] if dtype in TORCH_DTYPE_BYTES and floating else DTYPE_BYTES.get(dtype_name, 4)
    return numel * size


def weight_bytes(model_dir: Path, dtype: str | None = None) -> int:
    """Sum of tensor sizes over the checkpoint (safetensors headers or .bin); its float tensors re-scaled to
    `dtype` if given, quantized data counted as published. A migration that converted the checkpoint runs
    (and so estimates) the converted one: the plan's checkpoint."""
    return sum(_tensor_bytes(n, d, dtype) for n, d in checkpoint_tensors(model_dir).values())


def sharded_bytes(model_dir: Path, config: dict, dtype: str | None = None) -> int | None:
    """Bytes of the weights the model's tensor-parallel plan shards; None: no plan."""
    patterns = plan_patterns(config)
    if patterns is None:
        return None
    return sum(_tensor_bytes(n, d, dtype) for key, (n, d) in checkpoint_tensors(model_dir).items()
               if any(p.search(key) for p in patterns))


def kv_cache_bytes(config: dict, batch_size: int, seq_len: int, dtype: str = "bfloat16") -> int:
    """KV cache for batch x seq tokens. MLA caches the latent + rope key; sliding layers cap at
    the window; linear-attention / Mamba layers keep a fixed-size state instead."""
    config = config.get("text_config") or config
    elt = TORCH_DTYPE_BYTES.get(dtype, 2)
    layers = config.get("num_hidden_layers") or config.get("n_layer") or 0
    if config.get("kv_lora_rank"):
        per_token_layer = config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
        return batch_size * seq_len * layers * per_token_layer * elt
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads)
    layer_types = config.get("layer_types") or ["full_attention"] * layers
    window = config.get("sliding_window")
    total = 0
    for kind in layer_types[:layers]:
        kind = str(kind)
        if "linear" in kind or "mamba" in kind:
            total += recurrent_state_bytes(config, batch_size, elt)
            continue
        # A sliding layer keeps the last window-1 tokens (the new token completes the window).
        tokens = min(seq_len, window - 1) if window and ("sliding" in kind or "local" in kind) else seq_len
        total += 2 * batch_size * tokens * kv_heads * head_dim * elt
    return total


def recurrent_state_bytes(config: dict, batch_size: int, elt: int) -> int:
    """One linear-attention (gated delta net) or Mamba layer's state: convolution window + recurrent state."""
    if config.get("linear_num_value_heads"):
        k_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        v_heads, v_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
        conv = (2 * k_dim + v_heads * v_dim) * config.get("linear_conv_kernel_dim", 4)
        recurrent = v_heads * config["linear_key_head_dim"] * v_dim
        return batch_size * (conv + recurrent) * elt
    inner = config.get("mamba_expand", config.get("expand", 2)) * config["hidden_size"]
    state = config.get("mamba_d_state", config.get("state_size", 16))
    groups = config.get("mamba_n_groups", config.get("n_groups", 1))
    conv = (inner + 2 * groups * state) * config.get("mamba_d_conv", config.get("conv_kernel", 4))
    return batch_size * (conv + inner * state) * elt


def kv_heads_of(config: dict) -> int | None:
    config = config.get("text_config") or config
    if config.get("kv_lora_rank"):
        return None  # MLA: one latent per token, not split by heads
    return config.get("num_key_value_heads") or config.get("num_attention_heads") or config.get("n_head")


# Memory a process uses before the model: framework, allocator pools, (on NPU) CANN workspace.
RUNTIME_BYTES = {"cpu": 512 * 2**20, "cuda": 1 * 2**30, "npu": 2 * 2**30}


# a routed expert's tensors: per-expert ("experts.3.gate_proj") or stacked ("experts.gate_up_proj"); not the shared
ROUTED_EXPERT = re.compile(r"(^|\.)experts\.")
SHARED_EXPERT = re.compile(r"(^|\.)shared_experts?\.")


def expert_bytes(model_dir: Path, config: dict, dtype: str | None = None) -> tuple[int, int, int]:
    """(routed experts' bytes, shared experts' bytes, bytes of the other tensors the tensor-parallel plan shards)."""
    patterns = plan_patterns(config) or []
    routed = shared = rest = 0
    for key, (n, d) in checkpoint_tensors(model_dir).items():
        size = _tensor_bytes(n, d, dtype)
        if SHARED_EXPERT.search(key):
            shared += size
        elif ROUTED_EXPERT.search(key):
            routed += size
        elif any(p.search(key) for p in patterns):
            rest += size
    return routed, shared, rest


def estimate(model_dir: Path, config: dict, dtype: str, batch_size: int, seq_len: int,
             device_bytes: int | None, device: str = "cpu", slack: float = 1.2,
             runtime_bytes: int | None = None, expert_parallel: bool = False) -> dict:
    """Per rank, for tp = 1, 2, 4, 8, 16: weights (the plan's sharded part / tp + the rest) + KV
    cache (split by KV heads), x slack for activations and fragmentation, + the runtime's share,
    against one card's memory. `cards_needed`: the smallest tp that fits (None: none does, or no
    plan and one card is too small). `expert_parallel` (a native MoE model, whose N-card layout is
    agent.recipe.native.preflight.expert_parallel_layout): a rank holds only its local experts (E / moe_ep_size,
    their widths / moe_tp_size) and the shared experts split by moe_tp_size; each row names its layout."""
    from agent.recipe.native.preflight import experts_of, expert_parallel_layout

    weights = weight_bytes(model_dir, dtype)
    kv = kv_cache_bytes(config, batch_size, seq_len, dtype)
    runtime = RUNTIME_BYTES.get(device, RUNTIME_BYTES["cpu"]) if runtime_bytes is None else runtime_bytes
    sharded = sharded_bytes(model_dir, config, dtype)
    kv_heads = kv_heads_of(config)
    experts = experts_of(config.get("text_config") or config) if expert_parallel else None
    routed, shared, rest = expert_bytes(model_dir, config, dtype) if experts else (0, 0, 0)
    per_rank = {}
    for tp in TP_SIZES if sharded is not None or experts else (1,):
        layout = expert_parallel_layout(config, tp) if experts else None
        if layout is not None:
            # the experts by the expert-parallel layout, the rest as the tensor-parallel plan shards it
            moe_tp = layout["moe_tp_size"]
            ep = tp // moe_tp
            rank_weights = (weights - routed - shared - rest + math.ceil(rest / tp)
                            + math.ceil(routed * (experts // ep) / experts / moe_tp) + math.ceil(shared / moe_tp))
        else:
            rank_weights = weights - sharded + math.ceil(sharded / tp) if sharded is not None else weights
        rank_kv = math.ceil(kv / tp) if kv_heads and kv_heads % tp == 0 else kv
        need = int((rank_weights + rank_kv) * slack) + runtime
        per_rank[tp] = {"weights_bytes": rank_weights, "kv_cache_bytes": rank_kv, "needed_bytes": need,
                        "fits": None if not device_bytes else need <= device_bytes}
        if layout is not None:
            per_rank[tp].update(layout=layout, local_experts=experts // (tp // layout["moe_tp_size"]))
    needed = per_rank[1]["needed_bytes"]
    cards = None
    if device_bytes:
        cards = next((tp for tp, row in per_rank.items() if row["fits"]), None)
    return {"weights_bytes": weights, "kv_cache_bytes": kv, "runtime_bytes": runtime, "needed_bytes": needed,
            "needed_gib": needed / 2**30, "device": device, "device_bytes": device_bytes,
            "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype,
            "tp_sharded_bytes": sharded, "per_rank": per_rank, "routed_expert_bytes": routed if experts else None,
            "cards_needed": cards, "suggested_world_size": cards}


def process_memory_limit() -> int | None:
    """The run's own cap (ulimit -d / -v), inherited by infer.sh: memory it may really use."""
    limits = []
    for which in (resource.RLIMIT_DATA, resource.RLIMIT_AS):
        soft, _ = resource.getrlimit(which)
        if soft not in (resource.RLIM_INFINITY, -1):
            limits.append(soft)
    return min(limits) if limits else None


def simulated_card_bytes() -> int | None:
    """MIGRATOR_DEVICE_MEMORY_BYTES (tests and CPU only): the size of a simulated card, which the
    engine enforces on the weights each rank holds (engine.loading.check_device_memory); a value
    that is not a size is one line (exit 2)."""
    try:
        return parse_card_bytes()
    except ValueError as exc:
        raise InputError(str(exc)) from None


# accelerate's own answer, asked in a child process: get_max_memory() puts a tensor on every visible
# card, and a context held by this process would take memory from the runs it starts next; a broken
# torch_npu cannot break this process's torch either. TORCH_DEVICE_BACKEND_AUTOLOAD=0 as in the engine:
# accelerate imports torch_npu itself (is_npu_available), and why that fails is recorded.
_ACCELERATE_QUERY = r"""
import importlib.util, json
def why(exc):
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "(no message)")
    return f"{type(exc).__name__}: {text[:200]}"
out = {}
try:
    import torch
    from accelerate.utils import get_max_memory, is_npu_available
    npu = is_npu_available()
    if not npu and importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu
        except Exception as exc:
            out["torch_npu"] = why(exc)
    out["kind"] = "npu" if npu else ("cuda" if torch.cuda.is_available() else None)
    out["memory"] = {str(k): int(v) for k, v in get_max_memory().items()}
except Exception as exc:
    out["error"] = why(exc)
print("MEMORY " + json.dumps(out))
"""
ACCELERATE_SOURCE = "accelerate.utils.get_max_memory"
ACCELERATE_TIMEOUT_S = 120
_ACCELERATE_CACHE_S = 60.0
_accelerate_answer: tuple[float, dict] | None = None


def ask_accelerate() -> dict:
    """{"kind": "npu" | "cuda" | None, "memory": get_max_memory() with str keys (free bytes per card,
    "cpu": available host memory), "torch_npu": why it did not import} or {"error": why not}.
    Kept for a minute (one OOM estimate asks once)."""
    global _accelerate_answer
    if _accelerate_answer is not None and time.monotonic() - _accelerate_answer[0] < _ACCELERATE_CACHE_S:
        return _accelerate_answer[1]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    try:
        proc = subprocess.run([sys.executable, "-c", _ACCELERATE_QUERY], capture_output=True, text=True,
                              timeout=ACCELERATE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
        if lines:
            answer = loads_json(lines[-1][len("MEMORY "):])
        else:
            why = child_failure(proc.stderr, proc.returncode, no_answer="it printed no MEMORY line")
            answer = {"error": f"the query process printed no answer ({why})"}
    except subprocess.TimeoutExpired:
        answer = {"error": f"no answer within {ACCELERATE_TIMEOUT_S} s"}
    except (OSError, ValueError) as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    _accelerate_answer = (time.monotonic(), answer)
    return answer


def card_memory(env: Environment, ask: Callable[[], dict] = ask_accelerate) -> dict:
    """One card's memory for a run on env's device: {"bytes", "source", "fallback_reason"}.

    accelerate.utils.get_max_memory where it answers for that device (free memory of the tightest
    visible card; on the CPU the available host memory). Where it does not (accelerate or torch_npu
    broken, no such card seen), what the environment record read: torch's total for the card, else
    npu-smi's chip memory for an NPU, the host's MemTotal for the CPU; fallback_reason says why."""
    device = env.get("device", "cpu")
    answer = ask()
    memory = answer.get("memory") or {}
    if device == "cpu" and memory.get("cpu"):
        return {"bytes": int(memory["cpu"]), "source": f"{ACCELERATE_SOURCE} (available host memory)",
                "fallback_reason": None}
    cards = [int(v) for k, v in memory.items() if k.isdigit()]
    if device != "cpu" and answer.get("kind") == device and cards:
        return {"bytes": min(cards), "source": f"{ACCELERATE_SOURCE} (free memory, smallest of "
                f"{len(cards)} {device} card(s))", "fallback_reason": None}
    if "error" in answer:
        reason = f"{ACCELERATE_SOURCE} failed: {answer['error']}"
    else:
        reason = f"{ACCELERATE_SOURCE} saw no {device} card"
        if answer.get("torch_npu") and device == "npu":
            reason += f" (import torch_npu: {answer['torch_npu']})"
    fallbacks = {"cpu": [("device_memory_bytes", "/proc/meminfo MemTotal")],
                 "cuda": [("device_memory_bytes", "torch.cuda.get_device_properties")],
                 "npu": [("device_memory_bytes", "torch.npu.mem_get_info"),
                         ("npu_chip_memory_bytes", "npu-smi info")]}.get(device, [])
    for key, source in fallbacks:
        if env.get(key):
            return {"bytes": int(env[key]), "source": source, "fallback_reason": reason}
    return {"bytes": None, "source": None, "fallback_reason": reason}


def estimate_for_recipe(recipe: Recipe, env: Environment, plan: RunPlan | None = None) -> MemoryEstimate:
    """The estimate for the YAML and weights of the run plan (default: the recipe's own), read through
    the target's schema (an upstream recipe has no model_config.dtype: the checkpoint's dtype is what
    it loads)."""
    raw = recipe.settings(plan.yaml if plan else None)
    settings = recipe.target.schema.settings(raw)
    model_dir = plan.checkpoint if plan is not None and plan.checkpoint else recipe.checkpoint_dir()
    if model_dir is None:
        raise InputError(f"{recipe.path}: the YAML's model_path holds no config.json, so the memory need "
                         "cannot be estimated; set model_path to the checkpoint folder")
    config = load_json((model_dir / "config.json"))
    model_config = raw.get("model_config") if isinstance(raw.get("model_config"), dict) else {}
    dtype = model_config.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "float32"
    batch_size = int(settings["batch_size"] or 1)
    seq_len = int(settings["input_len"] or defaults.INPUT_MAX_LEN) + int(settings["max_new_tokens"] or defaults.MAX_NEW_TOKENS)
    device = env.get("device", "cpu")
    runtime = None
    simulated = simulated_card_bytes() if device == "cpu" else None
    if simulated:  # tests / CPU only: the "card" holds the model; the runtime lives on the host
        card = {"bytes": simulated, "source": "MIGRATOR_DEVICE_MEMORY_BYTES (a simulated card)",
                "fallback_reason": None}
        runtime = 0
    else:
        card = card_memory(env)
    device_bytes = card["bytes"]
    if device == "cpu" and not simulated:
        limit = process_memory_limit()
        if limit is not None and (device_bytes is None or limit < device_bytes):
            device_bytes, card["source"] = limit, "the process's memory limit (ulimit -d / -v)"
    from agent.recipe.native.preflight import is_native

    native = recipe.target.writes_native_models and is_native(recipe.path)
    memory = estimate(model_dir, config, dtype, batch_size, seq_len, device_bytes, device, runtime_bytes=runtime,
                      expert_parallel=native)
    memory.update(model_type=config.get("model_type"), device_memory_source=card["source"],
                  device_memory_fallback=card["fallback_reason"])
    return memory


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def out_of_memory(recipe: Recipe, memory: MemoryEstimate) -> str:
    """What an out-of-memory run needs, in one message. When N > 1 cards fit, the N-card YAML is
    written beside the single-card one (kept), named in `memory`, and the README says how to run it."""
    have = f"{_gib(memory['device_bytes'])} per {memory['device']} device" if memory["device_bytes"] \
        else "unknown device memory"
    message = (f"out of memory: needs about {memory['needed_gib']:.2f} GiB on one card (weights "
               f"{_gib(memory['weights_bytes'])} + KV cache {_gib(memory['kv_cache_bytes'])} + runtime) with {have}")
    cards = memory["cards_needed"]
    if cards and cards > 1:
        yaml_file = recipe.write_yaml_for(cards)
        per_rank = _gib(memory["per_rank"][cards]["needed_bytes"])
        expert = recipe.expert_parallel_layout(cards)      # a native MoE model: the experts expert parallel
        how = expert["how"] if expert else recipe.target.scaled_how(cards)
        command = recipe.target.launch_line(recipe, yaml_file.name)     # the target's own launch, not one kind's
        run = command.partition(" && ")[2]
        memory.update(multicard_yaml=yaml_file.relative_to(recipe.path).as_posix(), multicard_command=command)
        add_readme_section(recipe.path, "## On more cards",
                           f"The model does not fit one card ({have}); on {cards} cards, {how} "
                           f"(about {per_rank} per rank):\n\n```bash\n{run}\n```\n")
        return (f"{message}; {cards} cards fit ({how}, {per_rank} per rank): world_size: {cards} "
                f"written to config/{yaml_file.name}, run it with `{command}` or "
                f"`migrator run {recipe.path} --world-size {cards}` (the single-card recipe is kept)")
    if memory["tp_sharded_bytes"] is None:
        return f"{message}; {memory.get('model_type')} has no tensor-parallel plan, so more cards do not help"
    if cards is None and memory["device_bytes"]:
        return (f"{message}; even {max(memory['per_rank'])} cards do not fit (lower batch_size / input_max_len, "
                "or a smaller dtype)")
    return message


def add_readme_section(recipe_dir: Path, heading: str, body: str) -> None:
    """Append a section to the recipe's README once (a README without it, or no README: nothing)."""
    readme = recipe_dir / "README.md"
    if readme.is_file() and heading not in (text := readme.read_text()):
        from agent.recipe.fs_guard import user_tree

        user_tree(recipe_dir).write_text(readme, f"{text}\n{heading}\n\n{body}")



