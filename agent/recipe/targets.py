"""Targets as data (SPEC §7): where a recipe lives, what its files are, what runs it.

A target is one row of TARGETS. `standalone` is this project's own layout (SPEC §3) on its engine;
`legacy` and `framework` are cann-recipes-infer's two kinds of model folder. A row says how a
folder of that kind runs and is measured (scenarios B and C) and, when it has a `layout`, what the
migrator renders for it (scenario A): the files, the YAML schema and names, the README, where the
baseline goes and whether the checkout's registry gets a line (`registers`).

Adding a target is a row here plus its templates.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from engine.config import KEYS, Key, rendered_settings
from engine.safe_load import load_json, loads_json
from agent.recipe.chat_template import require_chat_template
from agent.errors import UnsupportedModelError
from agent.recipe.templating import DENSE_MOE_TP_NOTE, yaml_comments  # noqa: F401 - the YAMLs' comments
from agent.recipe import upstream_schema

# The shared entry point of a cann-recipes-infer checkout, and the file that marks a checkout.
ENTRY = Path("executor") / "scripts" / "infer.sh"
REGISTRY = Path("executor") / "core" / "support_models.py"


@dataclass(frozen=True)
class Launch:
    """One run of a recipe: the command, its working directory (None: the run's own folder, where
    upstream's launcher writes res/<date>/<case>/) and what it adds to the environment."""
    command: tuple[str, ...]
    cwd: Path | None
    env: Mapping[str, str] = field(default_factory=dict)


class Recipe(Protocol):
    """What a launch reads of agent.recipe.recipe.Recipe."""
    path: Path
    repo_root: Path | None
    yaml: Path | None


def dotted(data, key: str, missing=None):
    """data["a"]["b"] for key "a.b"; `missing` where a part is absent or not a mapping."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


@dataclass(frozen=True)
class YamlSchema:
    """Where one YAML schema keeps each setting the tool reads or fills: field -> dotted keys, the first
    present and non-empty wins. `settings(data)` is the one normaliser every reader of a YAML goes
    through (the baseline, the run plan, the memory estimate, the stand-in's copy)."""
    name: str
    fields: Mapping[str, tuple[str, ...]]

    def settings(self, data) -> dict:
        data = data if isinstance(data, dict) else {}
        out = {}
        for name, keys in self.fields.items():
            values = (dotted(data, key) for key in keys)
            out[name] = next((v for v in values if v is not None and v != ""), None)
        return out

    def get(self, data, field_name: str):
        return self.settings(data)[field_name]

    def key_for(self, data, field_name: str) -> str:
        """The key `field_name` is written at in `data`: the first of its keys present, else the first
        whose section is there, else the first (a YAML of either schema keeps its own form)."""
        keys = self.fields[field_name]
        present = next((k for k in keys if dotted(data, k) is not None), None)
        if present is None:
            present = next((k for k in keys if "." not in k or isinstance(dotted(data, k.rpartition(".")[0]), dict)),
                           keys[0])
        return present

    def set(self, data: dict, field_name: str, value) -> dict:
        """`data` with `field_name` set at its key (key_for; its sections made where missing)."""
        *sections, leaf = self.key_for(data, field_name).split(".")
        node = data
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[leaf] = value
        return data

    def world_size(self, data) -> int | None:
        try:
            return int(self.get(data, "world_size"))
        except (TypeError, ValueError):
            return None


# upstream's four-section InferenceConfig schema (docs/common/inference_config_guide.md)
SECTIONS_SCHEMA = YamlSchema("sections", {
    "model_name": ("model_config.model_name",), "model_path": ("model_config.model_path",),
    "model_source": ("model_config.model_source",), "exe_mode": ("model_config.exe_mode",),
    "world_size": ("parallel_config.world_size",), "max_new_tokens": ("scheduler_config.max_new_tokens",),
    "batch_size": ("scheduler_config.batch_size",), "input_len": ("data_config.input_truncated_len",),
    "dataset": ("data_config.dataset",)})
# the flat schema of ModelRunner recipes (models/pangu_7b) and of this project's engine (engine.config.KEYS)
FLAT_SCHEMA = YamlSchema("flat", {
    "model_name": ("model_name",), "model_path": ("model_path",), "model_source": ("model_source",),
    "exe_mode": ("exe_mode",), "world_size": ("world_size",), "max_new_tokens": ("data_config.max_new_tokens",),
    "batch_size": ("data_config.batch_size",), "input_len": ("data_config.input_max_len",),
    "dataset": ("data_config.dataset",)})
# a YAML of unknown kind: the sections first (what the executor reads where both are present), then flat
ANY_SCHEMA = YamlSchema("any", {name: SECTIONS_SCHEMA.fields[name] + FLAT_SCHEMA.fields[name]
                                for name in SECTIONS_SCHEMA.fields})
# upstream's placeholder for a path the user fills in (models/gpt_oss/config/*.yaml; checklist 二.4)
MODEL_PATH_PLACEHOLDER = "your_model_path"


def standalone_yaml_name(model_name: str, world_size: int = 1) -> str:
    return f"{model_name}_{world_size}card_eager.yaml"


def framework_yaml_name(model_name: str, world_size: int = 1) -> str:
    """upstream's names: config/{model_name}.yaml for one card (its skill's product layout); on N cards
    "model_rank_N_topology": N-way tensor parallel (NtP, as models/qwen's qwen3_8b_2tp.yaml)."""
    return f"{model_name}.yaml" if world_size <= 1 else f"{model_name}_rank_{world_size}_{world_size}tp.yaml"


# The exe_mode a framework YAML is written with: upstream's graph mode (checklist 一.4: a YAML enables it).
# The trial runs validate the YAML as written (under the stand-in the decode step is captured once, as
# on an NPU); eager is one field away (the README says so): no second YAML differs only in it (二.4).
FRAMEWORK_EXE_MODE = "npugraph_ex"


def framework_settings(ctx: dict) -> dict:
    """The four-section YAML upstream's InferenceConfig reads (docs/common/inference_config_guide.md),
    as data in its order. On N ranks the model class splits the model N ways by its own
    tensor-parallel plan (attention, MLP and experts; lm_head over lmhead_tp_group), so one
    data-parallel group holds the whole batch."""
    world_size = int(ctx.get("world_size") or 1)
    batch_size = int(ctx.get("batch_size") or 1)
    input_len = int(ctx["input_max_len"])
    return {
        "model_config": {"model_name": ctx["model_name"], "model_path": ctx["model_path"],
                         "exe_mode": FRAMEWORK_EXE_MODE, "enable_profiler": False, "with_ckpt": True},
        "data_config": {"dataset": "default", "input_truncated_len": input_len},
        "parallel_config": framework_parallel(world_size, is_moe(ctx)),
        "scheduler_config": {"batch_size": batch_size, "max_new_tokens": int(ctx["max_new_tokens"]),
                             "max_prefill_tokens": input_len * batch_size},
    }


def framework_pd_settings(settings: dict, native: bool) -> dict:
    """The `<name>_pd/prefill.yaml` + `decode.yaml` pair, as upstream's models/*/config/*_pd/ write it: both
    on the recipe's cards; the prefill role eager, one new token (it hands the cache to the decode role);
    the decode role in ge_graph where the native model has the torchair.ops decode path (upstream's
    qwen / qwen3_moe / deepseek_r1 decode.yaml), else the graph mode the adapter was verified in."""
    def copy() -> dict:
        return {key: dict(value) if isinstance(value, dict) else value for key, value in settings.items()}

    prefill, decode = copy(), copy()
    prefill["model_config"]["exe_mode"] = "eager"
    prefill["scheduler_config"]["max_new_tokens"] = 1
    decode["model_config"]["exe_mode"] = "ge_graph" if native else FRAMEWORK_EXE_MODE
    return {"prefill": prefill, "decode": decode}


MOE_FAMILIES = frozenset({"moe", "mla"})


def is_moe(ctx: dict) -> bool:
    family = ctx.get("family")
    return getattr(family, "name", family) in MOE_FAMILIES


def framework_parallel(world_size: int, moe: bool = True) -> dict:
    """N-way tensor parallel; a dense model's moe_tp_size stays 1, as upstream's 2tp YAMLs write it."""
    return {"world_size": world_size, "attn_tp_size": world_size, "moe_tp_size": world_size if moe else 1,
            "embed_tp_size": 1, "lmhead_tp_size": world_size}


FAMILY_LABELS = {"standard": "Dense（MHA / GQA）", "sliding_window": "Dense（滑动窗口注意力）",
                 "moe": "MoE", "mla": "MLA + MoE", "hybrid_recurrent": "线性注意力 / Mamba 混合"}


def framework_class_name(model_name: str) -> str:
    return "".join(part.capitalize() for part in model_name.split("_")) + "ForCausalLM"


def framework_registry_entry(ctx: dict) -> list[tuple[str, str]]:
    """The support_models.py line: (module, class) of the model, then of its configuration. A native
    model is modeling_NAME.py itself; the adapter wraps the vendored modeling_NAME.py."""
    name = ctx["model_name"]
    module = f"modeling_{name}" if ctx.get("native_model") else f"modeling_{name}_framework"
    entry = [(f"models.{name}.models.{module}", framework_class_name(name)),
             (f"models.{name}.models.configuration_{name}", ctx["config_class"])]
    # a native file with the checkpoint's MTP draft: its class between the model's and the config's, as
    # upstream's deepseek_r1 registers DeepseekV3ModelMTP (the executor runs it when next_n > 0)
    mtp_class = framework_class_name(name).removesuffix("ForCausalLM") + "ModelMTP"
    if ctx.get("native_model") and re.search(rf"^class {mtp_class}\(", ctx.get("native_source") or "", re.M):
        entry.insert(1, (f"models.{name}.models.{module}", mtp_class))
    return entry


# the framework model's file: native (agent.recipe.native) where the generator writes the architecture,
# else the adapter around the vendored code
FRAMEWORK_MODEL = {"framework/modeling_framework.py.j2": "models/modeling_{name}_framework.py"}
NATIVE_MODEL = {"framework/native/modeling.py.j2": "models/modeling_{name}.py"}


def framework_layout(layout: Mapping[str, str], ctx: dict) -> Mapping[str, str]:
    """The framework row's files for this render context: the native model in place of the adapter."""
    if not ctx.get("native_model"):
        return layout
    return {**NATIVE_MODEL, **{t: p for t, p in layout.items() if t not in FRAMEWORK_MODEL}}


def image_text_decoder(ctx: dict):
    """The text decoder of the recipe's checkpoint when it is an image-text one (agent.recipe.text_decoder), else
    None."""
    from agent.recipe.text_decoder import NotServedByText, text_decoder

    try:
        config = load_json(Path(ctx.get("model_path", "")) / "config.json")
    except (OSError, ValueError):
        return None
    try:
        return text_decoder(config) if isinstance(config, dict) else None
    except NotServedByText as exc:
        raise UnsupportedModelError(f"image-text model: {exc}") from None


def hub_link(source: str) -> str:
    """A link to where the checkpoint came from; never a path of this machine."""
    source = str(source or "")
    if source.startswith(("https://huggingface.co/", "https://modelscope.cn/")):
        return source
    parts = source.split("/")
    if len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and not Path(source).exists():
        return f"https://huggingface.co/{source}"
    return "本地权重（来源未注明）"


def parameter_count(model_path: str) -> str:
    """Parameters of the checkpoint from its safetensors headers (no tensor is read); "—" if unknown."""
    import json
    import struct

    total = 0
    try:
        for file in sorted(Path(model_path).glob("*.safetensors")):
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = loads_json(f.read(size))
            for key, info in header.items():
                if key != "__metadata__":
                    count = 1
                    for dim in info["shape"]:
                        count *= dim
                    total += count
    except (OSError, ValueError, KeyError, struct.error):
        return "—"
    if not total:
        return "—"
    return f"{total / 1e9:.1f}B" if total >= 1e8 else f"{total / 1e6:.2f}M"


def framework_names(ctx: dict) -> dict:
    """The framework model's class and the name its README and file header give the architecture."""
    name = ctx["model_name"]
    return {"framework_class": framework_class_name(name),
            "display_name": str(ctx.get("architecture") or name).removesuffix("ForCausalLM") or name}


def framework_context(ctx: dict, native: bool = True) -> dict:
    """What the framework (and legacy) templates add: one YAML per topology, in its exe_mode; `native`: the
    native-or-adapter decision the workflow recorded (ctx's `native_decision`, its summary, and `native_source`,
    the file its self-check ran; agent.workflow.nodes.node_decide_native) — a framework model, not legacy's
    runner. Nothing is decided here: a context without a decision renders the adapter."""
    name = ctx["model_name"]
    world_size = int(ctx.get("world_size") or 1)
    mode = ctx["settings"].get("exe_mode") or ctx["settings"].get("model_config", {}).get("exe_mode")
    files = [(framework_yaml_name(name, 1), f"单卡，{mode}")]
    if world_size > 1:
        files.append((framework_yaml_name(name, world_size), f"{world_size} 卡张量并行，{mode}"))
    names = framework_names(ctx)
    decision = ctx.get("native_decision") if native else None
    source = ctx.get("native_source") if native else None
    extra = {"exe_mode": mode, "native_decision": decision,
             "native_model": bool(decision and decision.get("native") and source),
             "native_source": source, "image_text": None}
    decoder = image_text_decoder(ctx)
    if decoder is not None:
        if not extra["native_model"]:
            # the adapter and the legacy runner run a causal LM's code on the checkpoint's names: not this one
            why = (extra["native_decision"] or {}).get("reason") or "the target writes no native model"
            raise UnsupportedModelError(f"{decoder.image_text_class}: image-text model served by its text decoder "
                                        f"({decoder.text_type}) only where the native generator writes it; here it "
                                        f"does not: {' '.join(str(why).split())[:200]}")
        extra["image_text"] = {"image_text_class": decoder.image_text_class, "text_type": decoder.text_type,
                               "decoder_prefix": decoder.decoder_prefix, "skipped": list(decoder.skipped),
                               "reduced": decoder.reduced}
    settings = {key: dict(value) if isinstance(value, dict) else value for key, value in ctx["settings"].items()}
    if extra["native_model"] and "mtp" in (decision.get("parts") or ()):
        # the checkpoint's MTP layer drafts one token per step, as upstream's deepseek_r1 _mtp YAMLs
        settings["model_config"]["next_n"] = 1
    expert = None
    if extra["native_model"]:
        from agent.recipe.native.preflight import expert_layout_of

        expert = expert_layout_of(Path(ctx.get("model_path", "")), world_size)
    if expert is not None:
        # a native MoE model on N cards: the experts expert parallel, as upstream's MoE YAMLs lay them out
        settings["parallel_config"].update(expert["parallel_config"])
        files[-1] = (framework_yaml_name(name, world_size), f"{world_size} 卡，{expert['how']}，{mode}")
    extra["settings"] = settings
    if native:          # the framework row (legacy's flat YAML has no prefill / decode pair)
        extra["pd_settings"] = framework_pd_settings(settings, extra["native_model"])
    return {**extra, **names,
            "family_label": FAMILY_LABELS.get(ctx["family"].name, ctx["family"].name),
            "hub_link": hub_link(ctx.get("model_source", "")),
            "parameter_count": parameter_count(ctx.get("model_path", "")),
            "yaml_list": "\n".join(f"   - `config/{file}` — {what}" for file, what in files),
            "dtype_label": "BF16", **readme_context(ctx)}


# What the vendoring codemods did, as the README says it (agent/migrate/vendor.py's sequence).
CODEMOD_LABELS = {
    "AbsoluteImportsCommand": "相对导入改为本目录内的绝对导入",
    "VendoredImportsCommand": "相对导入改为本目录内的绝对导入",
    "RunnerSettingsInitCommand": "模型类构造函数增加 runner_settings 参数",
    "TorchNpuImportGuardCommand": "导入 torch_npu（未安装时跳过）",
    "RemoveGradientCheckpointingCommand": "删除梯度检查点（训练专用）",
    "RemoveLabelsLossCommand": "删除 labels 与 loss 计算（训练专用）",
    "TransformersInitWeightsCommand": "权重初始化按 transformers 自身代码的方式进行",
    "PruneUnreachableDefinitionsCommand": "删除模型用不到的定义",
}


def readme_context(ctx: dict) -> dict:
    """The README's model-specific text: the configuration's facts, where the code comes from and
    what was changed in it, and the sections only a run fills (agent.recipe.readme)."""
    import json

    from agent.provenance import source_file
    from agent.recipe import readme

    try:
        config = load_json(Path(ctx.get("model_path", "")) / "config.json")
    except (OSError, ValueError):
        config = {}
    names = [n.strip() for n in str(ctx.get("modeling_codemods") or "").split(",") if n.strip() and n.strip() != "none"]
    edits = list(dict.fromkeys(CODEMOD_LABELS.get(n, n) for n in names))
    from agent import provenance

    prov = provenance.of_vendored_model(str(ctx.get("modeling_module") or ""), ctx.get("transformers_version"),
                                        ctx.get("model_source"), ctx.get("model_path")) if ctx.get("modeling_module") else None
    what = (f"{ctx['model_name']}: the framework model of cann-recipes-infer's unified executor for "
            f"{ctx.get('architecture') or ctx['model_name']}, around the modeling code vendored in modeling_{ctx['model_name']}.py")
    header = provenance.header_text(prov, " ".join(what.split())) if prov else f"# coding=utf-8\n# {what}\n"
    return {"source_header": header,
            "model_facts": "".join(readme.model_facts(config if isinstance(config, dict) else {})),
            "source_file": source_file(str(ctx.get("modeling_module") or "")) if ctx.get("modeling_module") else "—",
            "vendor_edits": ("改动：" + "；".join(edits)) if edits else "未作改动",
            "product_section": readme.product_section(None),
            "performance_section": readme.performance_section(None, "agentic/baseline/")}


def tensor_parallel_yaml(settings: dict, world_size: int, moe: bool = True) -> dict:
    """This project's YAML on N cards: tensor parallel over all of them."""
    settings = dict(settings, world_size=world_size)
    settings["parallel_config"] = {"attn_tp_size": world_size, "moe_tp_size": world_size,
                                   "lmhead_tp_size": world_size}
    return settings


def framework_tensor_parallel_yaml(settings: dict, world_size: int, moe: bool = True) -> dict:
    """A four-section YAML on N cards: N-way tensor parallel (see framework_settings); the batch and
    the prefill budget stay the single card's."""
    settings = {key: dict(value) if isinstance(value, dict) else value for key, value in settings.items()}
    settings.setdefault("parallel_config", {}).update(framework_parallel(world_size, moe))
    return settings


def legacy_settings(ctx: dict) -> dict:
    """A ModelRunner recipe's YAML (models/pangu_7b's schema: top-level model_name, model_path,
    exe_mode, world_size; model_config, data_config, parallel_config)."""
    world_size = int(ctx.get("world_size") or 1)
    return {
        "model_name": ctx["model_name"], "model_path": ctx["model_path"], "exe_mode": "eager", "world_size": world_size,
        # enable_online_split_weight: every rank reads model_path itself (not model_path/rank_N)
        "model_config": {"dtype": "bfloat16", "enable_profiler": False, "with_ckpt": True,
                         "enable_online_split_weight": True},
        "data_config": {"dataset": "default", "input_max_len": int(ctx["input_max_len"]),
                        "max_new_tokens": int(ctx["max_new_tokens"]), "batch_size": int(ctx.get("batch_size") or world_size)},
        "parallel_config": {"attn_tp_size": 1, "moe_tp_size": 1, "embed_tp_size": 1, "lmhead_tp_size": 1},
    }


def legacy_data_parallel_yaml(settings: dict, world_size: int, moe: bool = True) -> dict:
    """A ModelRunner YAML on N cards: every rank the whole model, the batch split by RANK_ID."""
    settings = {key: dict(value) if isinstance(value, dict) else value for key, value in settings.items()}
    settings["world_size"] = world_size
    settings.setdefault("parallel_config", {}).update(attn_tp_size=1, moe_tp_size=1, embed_tp_size=1, lmhead_tp_size=1)
    data = settings.setdefault("data_config", {})
    data["batch_size"] = max(1, int(data.get("batch_size") or 1)) * world_size
    return settings


def legacy_context(ctx: dict) -> dict:
    return {**framework_context(ctx, native=False), "runner_class": runner_class_name(ctx["model_name"])}


def runner_class_name(model_name: str) -> str:
    return "".join(part.capitalize() for part in model_name.split("_")) + "Runner"


# an infer.sh that takes its YAML from $YAML_FILE ($YAML_FILE, ${YAML_FILE}, ${YAML_FILE:-default})
_READS_YAML_FILE = re.compile(r"\$\{?YAML_FILE(?![A-Za-z0-9_])")


def reads_yaml_file(infer_sh: Path) -> bool:
    try:
        return bool(_READS_YAML_FILE.search(infer_sh.read_text(errors="replace")))
    except OSError:
        return False


# an infer.sh's own YAML line (upstream's legacy recipes): the value a quoted word (which may be
# "${YAML_FILE_NAME:-default.yaml}") or a bare one, ending in .yaml
_OWN_YAML_LINE = re.compile(r"""^(\s*(?:export\s+)?(?:YAML_FILE_NAME|YAML_FILE)=)"""
                            r"""("[^"\n]*\.ya?ml\}?"|'[^'\n]*\.ya?ml\}?'|[^"'\s#]+\.ya?ml)""", re.M)


def _run_infer_sh(recipe: Recipe, yaml: Path) -> Launch:
    """`bash infer.sh` in the recipe folder, given the plan's YAML through YAML_FILE when it reads that
    variable. One that names its YAML itself runs its own text (`bash -c`, in the recipe folder, so its
    paths resolve as they do) with only that name pointed at the plan's YAML (a run's copy); with no
    such line another YAML cannot be run (InputError; Recipe.run_plan refuses it before)."""
    infer_sh = recipe.path / "infer.sh"
    if reads_yaml_file(infer_sh):
        return Launch(("bash", str(infer_sh)), recipe.path,
                      {"YAML_FILE": os.path.relpath(yaml, recipe.path).replace(os.sep, "/")})
    if recipe.yaml is None or Path(yaml).resolve() == Path(recipe.yaml).resolve():
        return Launch(("bash", str(infer_sh)), recipe.path)
    from agent.errors import InputError

    rel = Path(os.path.relpath(yaml, recipe.path / "config")).as_posix()
    changed, n = _OWN_YAML_LINE.subn(lambda m: f'{m.group(1)}"{rel}"', infer_sh.read_text(encoding="utf-8", errors="replace"))
    if n == 0:
        raise InputError(f"{infer_sh}: no YAML_FILE_NAME= line to point at {rel}")
    return Launch(("bash", "-c", changed, str(infer_sh)), recipe.path)


def _run_entry_point(recipe: Recipe, yaml: Path) -> Launch:
    """The checkout's `executor/scripts/infer.sh --model NAME --yaml FILE`, with the checkout on
    PYTHONPATH; it runs in the run's own folder (it writes res/ under its working directory)."""
    # relative to config/ (infer.sh joins it to models/NAME/config/): a stand-in run's copy in our state folder is ../res/...
    rel = Path(os.path.relpath(yaml, recipe.path / "config")).as_posix()
    pythonpath = os.pathsep.join(filter(None, [str(recipe.repo_root), os.environ.get("PYTHONPATH")]))
    return Launch(("bash", str(recipe.repo_root / ENTRY), "--model", recipe.path.name, "--yaml", rel), None,
                  {"PYTHONPATH": pythonpath})


@dataclass(frozen=True)
class Target:
    name: str
    summary: str                                    # what runs it, for messages and --help
    launch: Callable[[Recipe, Path], Launch]        # (recipe, the run plan's YAML) -> the run
    yaml_name: Callable[[str, int], str]            # (model_name, world_size) -> file name in config/
    baseline_dir: str = "baseline"                  # relative to the recipe (see Recipe.baseline_dir)
    # What the migrator renders: template -> path in the recipe ({name}, {yaml_name} filled in); the
    # runner comes from the model's family (agent.recipe.routing). Empty: not rendered (yet).
    layout: Mapping[str, str] = field(default_factory=dict)
    readme_template: str | None = None
    yaml_schema: tuple[Key, ...] = ()
    yaml_settings: Callable[[dict], dict] | None = None   # render context -> the YAML as data
    # (model_name, Family) -> recipe path -> template of what the model's family adds (standalone: its runner)
    family_files: Callable[[str, object], dict[str, str]] = lambda name, family: {}
    context: Callable[[dict], dict] | None = None   # render context -> what the target's templates add
    # (layout, render context) -> the files for that context (the framework row: native or adapter model)
    layout_for: Callable[[Mapping[str, str], dict], Mapping[str, str]] | None = None
    # folders the migrator creates: agentic/ makes Recipe.baseline_dir() upstream's agentic/baseline/
    folders: tuple[str, ...] = ()
    carries: tuple[str, ...] = ()                   # packages of this project copied into the recipe
    vendored_package: str = "models"                # the vendored copies' package as the recipe imports them
    scale_yaml: Callable[..., dict] = tensor_parallel_yaml   # (1-card YAML, N, moe=) -> the N-card one
    scaled_how: Callable[[int], str] = lambda n: "tensor parallel"
    launch_hint: Callable[[str, str], str] = lambda folder, yaml: f"YAML_FILE=config/{yaml} bash infer.sh"
    # render context -> the (module, class) lines it adds to the checkout's REGISTRY; None: it adds none
    registry_entry: Callable[[dict], list[tuple[str, str]]] | None = None
    inside_checkout: bool = False                   # needs --output-dir inside a cann-recipes-infer checkout
    # a checkpoint it cannot serve: InputError before anything is written (framework: every prompt goes
    # through the tokenizer's chat template)
    check_checkpoint: Callable[[Path], None] = lambda model_dir: None
    schema: YamlSchema = FLAT_SCHEMA                # its YAMLs' schema: the one normaliser of their settings
    # the model_path its written YAMLs carry: upstream's placeholder (the run plan runs a copy with the
    # real path); None: the checkpoint's own path (a standalone recipe runs by itself, anywhere)
    model_path_placeholder: str | None = None
    # what verify checks beyond the run's precision, by name (agent.measure.verify.RECIPE_CHECKS): "vendored_code",
    # the vendored code alone held to transformers on a shrunk config with the YAML's config_overrides (every
    # recipe of a target with it is this tool's own)
    recipe_checks: tuple[str, ...] = ()
    # how its rank logs read (agent.measure.run_log): "runner" (a ModelRunner: warm-up then the formal
    # generate) or "executor" (upstream's executor: its own warm-up, no warm-up check)
    log_style: str = "runner"
    standin_runnable: bool = False                  # `--standin` runs it (a cann-recipes-infer recipe)
    # (YAML, checkout root, its name as shown) -> an evidence line per key the runner ignores (framework: the old
    # flat keys upstream's executor drops silently, agent.recipe.upstream_schema)
    ignored_yaml_keys: Callable[[Path, Path | None, str], list[str]] = lambda yaml, root, shown: []
    # where its model's model_type is read (agent.recipe.model_type.SOURCES), in order
    model_type_sources: tuple[str, ...] = ("configuration_files",)
    # where the name it runs under is read (agent.recipe.recipe.Recipe.model_name), in order; "folder" always answers
    model_name_sources: tuple[str, ...] = ("runner", "report", "yaml", "folder")
    is_recipe: bool = True

    @property
    def renders(self) -> bool:
        return bool(self.layout)

    def launch_line(self, recipe: Recipe, yaml_name: str) -> str:
        """The shell line a person types to run `yaml_name` (a file in config/) of `recipe`: from the
        checkout's root for a recipe inside one, else from the recipe folder."""
        where = recipe.repo_root if self.inside_checkout and recipe.repo_root is not None else recipe.path
        return f"cd {where} && {self.launch_hint(recipe.path.name, yaml_name)}"

    @property
    def runs_own_infer_sh(self) -> bool:
        """Its launch is the recipe's own infer.sh (which picks its YAML itself unless it reads YAML_FILE)."""
        return self.launch is _run_infer_sh

    @property
    def writes_native_models(self) -> bool:
        """Its model files are chosen per render (agent.recipe.native: the native model, or the adapter)."""
        return self.layout_for is not None

    def files(self, ctx: dict | None = None) -> dict[str, str]:
        """template -> recipe path of every file rendered for this target (the runner aside); with a
        render context, the files for it (layout_for)."""
        layout = self.layout_for(self.layout, ctx) if ctx is not None and self.layout_for else self.layout
        return {**layout, **({self.readme_template: "README.md"} if self.readme_template else {})}


TARGETS: dict[str, Target] = {
    "standalone": Target(
        "standalone", "the recipe's infer.sh, on infer-migrator's engine", _run_infer_sh, standalone_yaml_name,
        layout={
            "infer.py.j2": "infer.py",
            "infer.sh.j2": "infer.sh",
            "config.yaml.j2": "config/{yaml_name}",
            "model_setting.py.j2": "models/model_setting.py",
            "requirements.txt.j2": "requirements.txt",
        },
        readme_template="README.md.j2", yaml_schema=KEYS, yaml_settings=rendered_settings,
        family_files=lambda name, family: {f"runner_{name}.py": family.runner_template},
        # the engine the runner subclasses travels with the recipe: it runs where infer-migrator is not installed
        carries=("engine",), recipe_checks=("vendored_code",)),
    # cann-recipes-infer's ModelRunner recipes: their own infer.sh (sourcing executor/scripts/function.sh),
    # a runner subclassing executor.model_runner.ModelRunner (models/pangu_7b's layout).
    "legacy": Target(
        "legacy", "the recipe's infer.sh (executor/scripts/function.sh's launch)", _run_infer_sh, framework_yaml_name,
        folders=("agentic",),
        layout={
            "legacy/runner.py.j2": "runner_{name}.py",
            "legacy/infer.py.j2": "infer.py",
            "legacy/infer.sh.j2": "infer.sh",
            "legacy/config.yaml.j2": "config/{yaml_name}",
            "framework/requirements.txt.j2": "requirements.txt",
        },
        readme_template="legacy/README.md.j2", yaml_settings=legacy_settings, context=legacy_context,
        inside_checkout=True, scale_yaml=legacy_data_parallel_yaml, scaled_how=lambda n: "data parallel",
        standin_runnable=True, model_path_placeholder=MODEL_PATH_PLACEHOLDER,
        # any folder with its own infer.sh: its YAML may be the flat ModelRunner one or the four sections
        schema=ANY_SCHEMA,
        launch_hint=lambda folder, yaml: f"YAML_FILE=config/{yaml} bash models/{folder}/infer.sh",
        model_type_sources=("runner_init", "configuration_files")),
    # cann-recipes-infer's framework models: config/*.yaml run by the checkout's shared entry point;
    # the model class is a generic adapter of the vendored HF code to the executor's contract.
    "framework": Target(
        "framework", f"{ENTRY.as_posix()} --model NAME --yaml FILE", _run_entry_point, framework_yaml_name,
        folders=("agentic",),
        layout={
            "framework/modeling_framework.py.j2": "models/modeling_{name}_framework.py",
            "framework/config.yaml.j2": "config/{yaml_name}",
            "framework/requirements.txt.j2": "requirements.txt",
            # the online prefill / decode pair (checklist 一.5; infer.sh --mode online's defaults)
            "framework/pd_prefill.yaml.j2": "config/{name}_pd/prefill.yaml",
            "framework/pd_decode.yaml.j2": "config/{name}_pd/decode.yaml",
        },
        readme_template="framework/README.md.j2", yaml_settings=framework_settings, context=framework_context,
        layout_for=framework_layout, vendored_package="models.{name}.models", registry_entry=framework_registry_entry,
        inside_checkout=True, check_checkpoint=require_chat_template,
        scale_yaml=framework_tensor_parallel_yaml, scaled_how=lambda n: f"{n}-way tensor parallel",
        launch_hint=lambda folder, yaml: f"bash {ENTRY.as_posix()} --model {folder} --yaml {yaml}",
        schema=SECTIONS_SCHEMA, model_path_placeholder=MODEL_PATH_PLACEHOLDER, log_style="executor",
        standin_runnable=True, ignored_yaml_keys=upstream_schema.check, model_name_sources=("folder",),
        model_type_sources=("registry", "configuration_files")),
}


def _not_runnable(recipe: Recipe, yaml: Path) -> Launch:
    from agent.errors import InputError

    raise InputError(f"{recipe.path}: not a recipe; nothing runs it")


# What a folder that is no recipe (a checkpoint, a model folder, anything else) answers: its YAMLs read
# in either schema, nothing launches it, its baseline and names are those of this project's layout.
NOT_A_RECIPE = Target("none", "nothing (not a recipe)", _not_runnable, standalone_yaml_name, schema=ANY_SCHEMA,
                      is_recipe=False, model_type_sources=("registry", "runner_init", "configuration_files"))


# The layout this project renders for itself (SPEC §3): what render.py renders when no row is named, and
# what a damaged recipe of it is re-rendered in (agent.repair.rules.files).
OWN_LAYOUT = TARGETS["standalone"]


def target_of(kind: str) -> Target:
    """The row of a folder's kind (agent.recipe.recipe.Recipe.kind); NOT_A_RECIPE for any other kind."""
    return TARGETS.get(kind, NOT_A_RECIPE)


def checkout_root(path: Path) -> Path | None:
    """The cann-recipes-infer checkout holding `path`: the nearest folder at or above it with
    executor/core/support_models.py."""
    path = Path(path).expanduser().resolve()
    return next((p for p in (path, *path.parents) if (p / REGISTRY).is_file()), None)


def default_target(output_dir: Path) -> str:
    """`framework` for an output dir inside a checkout (upstream's default for new models) once
    that row renders; `standalone` otherwise."""
    if checkout_root(output_dir) is not None and TARGETS["framework"].renders:
        return "framework"
    return "standalone"


def renderable_targets() -> list[str]:
    return [name for name, target in TARGETS.items() if target.renders]


def choose_target(requested: str | None, output_dir: Path) -> str:
    """The target a migration renders: the one asked for (checked against the output dir), else the
    default for the output dir. A bad choice is an InputError (exit 2) that says what to do."""
    from agent.errors import InputError

    if requested is None:
        return default_target(output_dir)
    if requested not in TARGETS:
        raise InputError(f"--target {requested!r}: choose one of {', '.join(TARGETS)}")
    target = TARGETS[requested]
    if not target.renders:
        raise InputError(f"--target {requested}: this release does not write {requested} recipes yet; "
                         f"use --target {' or --target '.join(renderable_targets())}")
    if target.inside_checkout and checkout_root(output_dir) is None:
        raise InputError(f"--target {requested} needs --output-dir inside a cann-recipes-infer checkout "
                         f"(a folder above it with {REGISTRY.as_posix()}); {output_dir} is not; "
                         "use --target standalone or point --output-dir at CHECKOUT/models")
    if target.inside_checkout and Path(output_dir).expanduser().resolve() != checkout_root(output_dir) / "models":
        raise InputError(f"--target {requested}: --output-dir must be the checkout's models/ folder "
                         f"({checkout_root(output_dir) / 'models'}), where {ENTRY.as_posix()} --model NAME looks")
    return requested


def state_parts(folder: Path) -> tuple[str, ...]:
    """Where this tool keeps its state, runs, backups and parity dumps under `folder`: `.migrator/`;
    inside a cann-recipes-infer checkout `res/.migrator/`, which upstream's .gitignore (`**/res/**`)
    keeps out of the checkout's tree, as it does the launcher's own res/ logs."""
    return ("res", ".migrator") if checkout_root(folder) is not None else (".migrator",)


def state_dir(folder: Path) -> Path:
    return Path(folder).joinpath(*state_parts(folder))


RUN_CHECKPOINTS = "checkpoints"


def run_checkpoints_dir(folder: Path) -> Path:
    """Where a migration writes the checkpoints its recipe runs when they are not the source (a conversion to
    bf16, --quantize's output, a view without the repo's code): in the recipe's state folder, never in the
    user's checkpoint (agent.workflow.store.publish moves the staged recipe in around them)."""
    return state_dir(folder) / RUN_CHECKPOINTS
