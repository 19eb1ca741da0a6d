"""The sections of a framework recipe's README that only a run can fill: 支持的产品型号 and 性能基线.

The README is rendered before anything ran (agent/recipe/render.py), so these sections start as
"not yet run on an NPU" / "no baseline yet"; the one writer of baselines (agent.measure.baseline
.write_baseline) rewrites them from the baseline it writes (`refresh`). Both the template and the
rewrite take their text from the functions here, so what the README says is only what a baseline
records: the product line from an NPU run's environment (`npu_model`), never from a stand-in or a
host run; the performance row from an NPU baseline's own figures only: a stand-in or host run's
timings are never shown as performance (the table says it is not measured on an NPU and which
command fills it; the honest stand-in record stays in its baseline file).
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.recipe.fs_guard import user_tree

NOT_RUN_ON_NPU = "尚未在 NPU 上运行（not yet run on an NPU）：本样例的产品型号支持待 NPU 实测后填写。"
NOT_MEASURED_ON_NPU = "尚未在 NPU 上测量性能（not measured on an NPU）："
PRODUCT_HEADING = "## 支持的产品型号"
PERFORMANCE_HEADING = "## 性能基线"
TABLE_HEAD = ("| 量化模式 | Global Batch Size | Seq Length (in/out) | 卡数 | TPOT (ms) | 吞吐 (tokens/s) |\n"
              "|------------|-------------------|---------------------------|-------|-----------|------------------------|")

# Ascend chip names (npu-smi's / torch_npu's get_device_name) -> upstream's product lines.
_PRODUCT_LINES = ((re.compile(r"910_?93|910C", re.I), "Atlas A3 系列产品"),
                  (re.compile(r"910B|910_?9[0-2]|910_?B", re.I), "Atlas A2 系列产品"))


def product_line(npu_model: str | None) -> str | None:
    """upstream's product line of an Ascend chip name, or None when it is not known."""
    for pattern, line in _PRODUCT_LINES:
        if npu_model and pattern.search(npu_model):
            return line
    return None


def ran_on_npu(baseline: dict | None) -> bool:
    """The baseline comes from a run on an Ascend NPU: its environment names one, and it is no stand-in."""
    env = (baseline or {}).get("environment") or {}
    return bool(baseline) and not baseline.get("standin") and env.get("device") == "npu" and bool(env.get("npu_model"))


def product_section(baseline: dict | None = None) -> str:
    """The body of 支持的产品型号: the product line of the NPU the baseline ran on, else that it has not run on one."""
    if not ran_on_npu(baseline):
        return NOT_RUN_ON_NPU
    model = baseline["environment"]["npu_model"]
    line = product_line(model)
    if line is None:
        return f"已在 {model} 上运行（产品系列未识别，请按实际产品填写）。"
    return f"<term>{line}</term>\n\n已在 {model} 上运行并采集基线。"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def performance_section(baseline: dict | None, baseline_file: str, settings: dict | None = None,
                        dtype_label: str = "BF16") -> str:
    """The body of 性能基线: the table row of the baseline (`baseline_file`: its recipe-relative path;
    `settings`: the YAML it ran, for the batch and lengths), or that there is none yet."""
    if not baseline:
        return (f"尚无基线：本样例尚未运行，运行后由 migrator 从 `{baseline_file}` 填写下表。\n\n{TABLE_HEAD}\n"
                "| — | — | — | — | — | — |")
    settings = settings or {}
    scheduler = settings.get("scheduler_config") or {}
    data = settings.get("data_config") or {}
    parallel = settings.get("parallel_config") or {}
    env = baseline.get("environment") or {}
    perf = baseline.get("performance") or {}
    # the framework schema (scheduler_config, data_config.input_truncated_len) or a ModelRunner recipe's (data_config)
    batch = scheduler.get("batch_size", data.get("batch_size"))
    decode = perf.get("decode_avg_ms")
    throughput = batch * 1000.0 / decode if isinstance(batch, int) and decode else None
    length = (f"≤{data.get('input_truncated_len', data.get('input_max_len', '—'))}/"
              f"{scheduler.get('max_new_tokens', data.get('max_new_tokens', '—'))}")
    shown_batch = batch if batch is not None else "—"
    if not ran_on_npu(baseline):
        # a run off an NPU (the stand-in, a host) measured the host: never shown as performance
        host = env.get("device") or "host"
        model = settings.get("model_config") if isinstance(settings.get("model_config"), dict) else {}
        name = (baseline.get("model_config") or {}).get("model_name") or model.get("model_name") \
            or settings.get("model_name") or "NAME"
        note = (f"{NOT_MEASURED_ON_NPU}在 NPU 主机上运行 `migrator run models/{name}`（它执行推理并采集基线）后，"
                f"由它填写下表。本样例在 {host} 上的验证运行记录在 `{baseline_file}`（主机耗时，不是 NPU 性能）。"
                + precision_sentence(baseline))
        row = f"| {dtype_label} | {shown_batch} | {length} | — | — | — |"
        return f"{note}Seq Length 的输入为 YAML 的输入长度上限。\n\n{TABLE_HEAD}\n{row}"
    cards = f"{env.get('num_cards') or parallel.get('world_size') or 1}×{env['npu_model']}"
    note = f"在 {env['npu_model']} 上采集（详见 `{baseline_file}`）。" + precision_sentence(baseline)
    row = f"| {dtype_label} | {shown_batch} | {length} | {cards} | {_fmt(decode)} | {_fmt(throughput, 1)} |"
    return f"{note}Seq Length 的输入为 YAML 的输入长度上限。\n\n{TABLE_HEAD}\n{row}"


def precision_sentence(baseline: dict) -> str:
    """How the run's output was checked, as the baseline's verification.parity records it ('' when not checked)."""
    parity = ((baseline or {}).get("verification") or {}).get("parity") or {}
    if not parity.get("checked"):
        return ""
    verdict = "一致" if parity.get("ok") else "不一致"
    figures = [f"{label} {parity[key]:.4g}" for key, label in (("max_abs_logits_diff", "最大 logits 偏差"),
                                                               ("tolerance", "容差"))
               if isinstance(parity.get(key), (int, float)) and not isinstance(parity.get(key), bool)]
    reference = parity.get("reference") or "transformers"
    return (f"精度：与 {reference} 的参考输出对比{verdict}" + (f"（{'，'.join(figures)}）" if figures else "")
            + ("；权重为随机初始化，仅验证计算一致性" if parity.get("untrained_weights") else "") + "。")


def replace_section(text: str, heading: str, body: str) -> str:
    """`text` with the body of its `heading` section (up to the next `## ` heading) replaced; as it is
    when it has no such section (a README the user rewrote)."""
    start = text.find(f"\n{heading}\n")
    if start < 0:
        return text
    start += len(heading) + 2
    nxt = text.find("\n## ", start)
    end = nxt + 1 if nxt >= 0 else len(text)
    return text[:start] + "\n" + body.strip("\n") + "\n\n" + text[end:].lstrip("\n") if nxt >= 0 \
        else text[:start] + "\n" + body.strip("\n") + "\n"


def refresh(recipe_dir: Path, baseline: dict, baseline_file: str, settings: dict | None = None) -> bool:
    """Rewrite the recipe's README's product and performance sections from `baseline`; True when it
    changed. A README without those sections (not ours, or rewritten) is left as it is."""
    readme = recipe_dir / "README.md"
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return False
    if readme.is_symlink():
        return False
    new = replace_section(text, PRODUCT_HEADING, product_section(baseline))
    new = replace_section(new, PERFORMANCE_HEADING, performance_section(baseline, baseline_file, settings))
    if new == text:
        return False
    user_tree(recipe_dir).write_text(readme, new)

    return True


QUANTIZATION_HEADING = "## 量化"


def quantization_section(quant: dict) -> str:
    """The body of 量化 for a recipe migrated with --quantize: the checkpoint written, its format, the command
    that redoes it, and the cost of quantizing against the float original (its line from
    agent.measure.quant_cost, `cost_line`)."""
    kept = "、".join(f"`{n}`" for n in quant.get("kept_float") or []) or "无"
    return (f"权重由 migrator 量化为 {str(quant.get('scheme', '')).upper()}：{quant.get('format')}。"
            f"量化配置随权重目录 config.json 的 `quantization_config`（compressed-tensors）加载，YAML 无需声明。\n\n"
            f"- 量化权重：`{quant.get('checkpoint')}`（由 `{quant.get('source')}` 转换，{quant.get('quantized_layers')} 个线性层为 int8；"
            f"保持浮点：{kept}）\n"
            f"- 重新转换：`{quant.get('command')}`\n"
            f"- 量化代价（对比浮点原始权重，transformers CPU）：{quant.get('cost_line') or 'not measured'}")


def write_quantization(recipe_dir: Path, quant: dict) -> bool:
    """The README's 量化 section, just before 性能基线 (its verdict), and the performance table's 量化模式
    cell, for a recipe migrated with --quantize; True when it changed. A README without 性能基线 is left alone."""
    readme = recipe_dir / "README.md"
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return False
    if readme.is_symlink() or f"\n{PERFORMANCE_HEADING}\n" not in text:
        return False
    body = quantization_section(quant)
    if f"\n{QUANTIZATION_HEADING}\n" in text:
        new = replace_section(text, QUANTIZATION_HEADING, body)
    else:
        new = text.replace(f"\n{PERFORMANCE_HEADING}\n", f"\n{QUANTIZATION_HEADING}\n\n{body}\n\n{PERFORMANCE_HEADING}\n", 1)
    label = str(quant.get("scheme", "")).upper()
    start = new.find(f"\n{PERFORMANCE_HEADING}\n")
    head, table = new[:start], new[start:]
    table = re.sub(r"^\| BF16 \|", f"| {label} |", table, count=1, flags=re.M)
    new = head + table
    if new == text:
        return False
    user_tree(recipe_dir).write_text(readme, new)
    return True


# ---- the model's own facts (概述), from its configuration -----------------------------------------
def _first(config: dict, *keys):
    return next((config[k] for k in keys if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)), None)


def model_facts(config: dict) -> list[str]:
    """Complete Chinese sentences on the model's structure, each from its configuration (the text
    model's, for a multimodal one); a fact the configuration does not state is left out."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    facts = []
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head")
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _first(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    if layers and hidden:
        facts.append(f"模型由 {layers} 层 Transformer 解码层组成，隐藏维度为 {hidden}"
                     + (f"，前馈层中间维度为 {cfg['intermediate_size']}" if isinstance(cfg.get("intermediate_size"), int) else "")
                     + "。")
    if heads:
        kind = "多头注意力（MHA）" if kv_heads == heads else ("多查询注意力（MQA）" if kv_heads == 1 else "分组查询注意力（GQA）")
        facts.append(f"注意力为{kind}：{heads} 个查询头、{kv_heads} 个 KV 头"
                     + (f"，每个头的维度（head_dim）为 {head_dim}" if head_dim else "") + "。")
    if isinstance(cfg.get("kv_lora_rank"), int):
        facts.append(f"注意力采用 MLA（Multi-head Latent Attention），KV 低秩压缩维度为 {cfg['kv_lora_rank']}"
                     + (f"，RoPE 部分的头维度为 {cfg['qk_rope_head_dim']}" if isinstance(cfg.get("qk_rope_head_dim"), int) else "")
                     + "。")
    context = _first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length")
    if context:
        facts.append(f"最大上下文长度为 {context} 个 token。")
    if _first(cfg, "vocab_size"):
        tied = "，输入嵌入与 lm_head 共享权重" if cfg.get("tie_word_embeddings") else ""
        facts.append(f"词表大小为 {cfg['vocab_size']}{tied}。")
    window = _first(cfg, "sliding_window")
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    if window and (cfg.get("use_sliding_window", True) is not False):
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
        where = (f"{len(layer_types)} 层中有 {sliding} 层使用滑动窗口注意力、其余为全局注意力" if layer_types and sliding < len(layer_types)
                 else "各层均使用滑动窗口注意力")
        facts.append(f"{where}，窗口长度为 {window} 个 token。")
    experts = _first(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if experts:
        active = _first(cfg, "num_experts_per_tok", "moe_topk", "top_k")
        shared = _first(cfg, "n_shared_experts", "num_shared_experts")
        facts.append(f"前馈层为 MoE：{experts} 个路由专家" + (f"，每个 token 激活 {active} 个" if active else "")
                     + (f"，另有 {shared} 个共享专家" if shared else "") + "。")
    caps = [what for key, what in (("attn_logit_softcapping", "注意力 logits"), ("final_logit_softcapping", "输出 logits"))
            if _first(cfg, key)]
    if caps:
        facts.append(f"{' 与 '.join(caps)} 做 soft-capping（tanh 限幅）。")
    return facts
