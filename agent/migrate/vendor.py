"""Vendor a checkpoint's modeling and configuration source into a recipe.

The source is located through transformers' own auto mappings and the class's source file (never
by guessing file names), copied to `{recipe}/models/`, and rewritten by the codemods in
`vendoring_commands` (agent/codemods/commands/). Afterwards the code must not import any model class from
transformers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import libcst as cst
import libcst.matchers as m

from agent.recipe.fs_guard import user_tree
from agent.codemods._toolkit import dotted
from agent.codemods.commands.absolute_imports import AbsoluteImportsCommand
from agent.codemods.commands.blank_line_whitespace import BlankLineWhitespaceCommand
from agent.codemods.commands.prune_unreachable_definitions import PruneUnreachableDefinitionsCommand
from agent.codemods.commands.remove_gradient_checkpointing import RemoveGradientCheckpointingCommand
from agent.codemods.commands.remove_labels_loss import RemoveLabelsLossCommand
from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand
from agent.codemods.commands.source_header import SourceHeaderCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.codemods.commands.transformers_init_weights import TransformersInitWeightsCommand
from agent.codemods.commands.vendored_imports import VendoredImportsCommand
from agent.codemods.driver import Command, command, transform

from agent.errors import InputError, UnsupportedModelError, VendorError
from agent import provenance
from agent.migrate import codemod_cache
from agent.records import Vendored
from agent.recipe.render import is_identifier
from agent.recipe.routing import supported_families
from engine.safe_load import load_json


@dataclass
class ModelSource:
    """Where a checkpoint's implementation lives."""
    model_type: str
    architecture: str          # e.g. LlamaForCausalLM
    model_class: str
    config_class: str
    modeling_module: str       # e.g. transformers.models.llama.modeling_llama
    configuration_module: str
    modeling_file: Path
    configuration_file: Path
    origin: str                # "transformers <version>" or "remote code"
    attn_implementation: str = "sdpa"   # sdpa when the class supports it, else eager
    note: str | None = None    # why transformers' class serves a repo that ships its own code (auto_map)
    text_decoder_note: str | None = None   # an image-text checkpoint: what of it is served (its text decoder)

    def vendored(self) -> Vendored:
        """The classes as the workflow state and the report record them."""
        return {"model_class": self.model_class, "config_class": self.config_class,
                "modeling_module": self.modeling_module, "configuration_module": self.configuration_module,
                "origin": self.origin, "attn_implementation": self.attn_implementation,
                **({"auto_map_note": self.note} if self.note else {}),
                **({"text_decoder_note": self.text_decoder_note} if self.text_decoder_note else {})}


@dataclass
class VendorResult:
    source: ModelSource
    files: dict[str, Path] = field(default_factory=dict)   # role -> written file
    codemods: dict[str, list[str]] = field(default_factory=dict)  # file name -> codemods applied

    def vendored(self, recipe_dir: Path) -> Vendored:
        return {**self.source.vendored(),
                "files": {role: str(path.relative_to(recipe_dir)) for role, path in self.files.items()},
                "codemods": self.codemods}


def read_config(model_dir: Path) -> dict:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir}: no config.json — point at a Hugging Face model directory "
                         "(the folder that holds config.json and the weights)")
    try:
        return load_json(config_file)
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_file}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc


CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _refuse(arch: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: {why}; supported: decoder-only causal LMs "
                                 f"(families: {supported_families()})")


def check_servable(config: dict, model_dir: Path | None = None, download: str | None = None) -> None:
    """Refuse, in one line, what the recipes cannot serve (before any code is touched). A quantized checkpoint
    (agent.migrate.quantization, the one place its format is read): compressed-tensors W8A8 int8 is served as
    published, what the NPU cannot compute is converted to bf16 at migration (agent.migrate.convert), the rest
    is refused with the line naming its quantization and upstream's converter where one reads it (the
    checkpoint at `model_dir`, or fetched by `download`)."""
    from agent.migrate import quantization

    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and is_identifier(archs[0]) else \
        config.get("model_type") if is_identifier(str(config.get("model_type")).replace("-", "_")) else "the checkpoint"
    line = quantization.refusal(config, model_dir, download)
    if line:
        raise UnsupportedModelError(f"{arch}: {line}")
    if config.get("is_encoder_decoder") and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in config.get("architectures") or []):
        raise _refuse(arch, "encoder-decoder model (is_encoder_decoder: true)")


# Inputs of another modality: a class whose forward takes one of these is multimodal (images: IMAGE_INPUTS).
IMAGE_INPUTS = ("pixel_values", "pixel_values_videos", "image_embeds", "input_image_embeds", "image_pixel_values",
                "image_patches")
NON_TEXT_INPUTS = IMAGE_INPUTS + ("input_features", "input_values", "audio_values", "input_audio_embeds",
                                  "audio_input_features")
# Where an image-text checkpoint's config.json keeps its text decoder: transformers' composite configs
# (text_config), InternVL's and DeepSeek-VL2's remote code (llm_config, language_config).
TEXT_DECODER_KEYS = ("text_config", "llm_config", "language_config")
# Inputs a draft model takes from the model it drafts for (assisted generation).
TARGET_MODEL_INPUTS = ("shared_kv_states", "target_hidden_states")
_IS_DECODER_READ = re.compile(r"^(?!\s*>>>).*\bconfig\.is_decoder\b(?!\s*=[^=])", re.M)
_IS_DECODER_FORCED = re.compile(r"^\s*config\.is_decoder\s*=\s*True\b", re.M)


def refusal_reason(config: dict, model_cls: type) -> str | None:
    """Why the causal-LM class `model_cls` of a transformers checkpoint cannot be served, or None.

    Derived from the config and the class's code, never from its name: the modality of its
    inputs (forward parameters), the encoder-decoder flag, whether its attention is
    causal only as a decoder (`config.is_decoder`), and inputs only another model can provide.
    """
    name = model_cls.__name__
    try:
        params = set(inspect.signature(model_cls.forward).parameters)
    except (TypeError, ValueError):
        params = set()
    modal_inputs = sorted(params.intersection(NON_TEXT_INPUTS))
    if modal_inputs:
        # Judged by the class, not the config: a text-only causal-LM class of a multimodal family
        # (Qwen3_5ForCausalLM for a qwen3_5 config with a vision_config) serves text fine.
        evidence = f"{name}.forward takes {', '.join(modal_inputs)}"
        if params.intersection(IMAGE_INPUTS) or is_image_text(config):
            return image_text_reason(config, evidence)
        return f"multimodal model ({evidence}): checkpoints with audio inputs are not served"
    if config.get("is_encoder_decoder"):
        return (f"decoder half of an encoder-decoder model ({name} is the decoder, trained to attend to an "
                "encoder's output; is_encoder_decoder: true)")
    needs = sorted(params.intersection(TARGET_MODEL_INPUTS))
    if needs:
        return (f"draft model for assisted generation ({name}.forward needs {', '.join(needs)} from the "
                "model it drafts for); migrate that model instead")
    source = Path(inspect.getsourcefile(model_cls)).read_text()
    class_source = inspect.getsource(model_cls)
    if _IS_DECODER_READ.search(source) and not _IS_DECODER_FORCED.search(class_source) and not config.get("is_decoder"):
        return "encoder-only model (bidirectional attention; is_decoder is not set)"
    return None


def is_image_text(config: dict) -> bool:
    """An image-text checkpoint by its config (agent.recipe.text_decoder, the one place that classifies them)."""
    from agent.recipe.text_decoder import is_image_text as classify

    return classify(config)


def image_text_reason(config: dict, evidence: str) -> str:
    """The one line for an image-text checkpoint that is not served (SPEC §9: they are served by their text decoder,
    agent.recipe.text_decoder, where the native generator writes it): what it is and why (`evidence`), its text
    decoder's model_type and whether the native generator writes that type."""
    return (f"image-text model ({evidence}); {text_decoder_note(config)}; image-text checkpoints are served by their "
            "text decoder only where the native generator writes it")


def text_decoder_note(config: dict) -> str:
    """`its text decoder is TYPE, …`: the model_type of the config's text part, whether transformers has a
    causal-LM class for it and whether the native generator writes it (agent.recipe.native.decide.type_note)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = next((config[key] for key in TEXT_DECODER_KEYS if isinstance(config.get(key), dict)), None)
    text_type = text.get("model_type") if text is not None else None
    if not isinstance(text_type, str) or not text_type:
        return "its text decoder has no separate config (no text_config with a model_type)"
    shown = text_type if len(text_type) <= 60 and is_identifier(text_type.replace("-", "_")) else repr(text_type[:60])
    version = transformers.__version__
    if text_type not in CONFIG_MAPPING_NAMES:
        return f"its text decoder is {shown}, a model_type transformers {version} does not know"
    if text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"its text decoder is {shown}, which has no causal-LM class in transformers {version} (the native "
                "generator does not write it)")
    from agent.recipe.native.decide import type_note

    return f"its text decoder is {shown} ({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text_type]}), {type_note(text_type, text)}"


def locate_source(config: dict, model_dir: Path | None = None, trust_remote_code: bool = False) -> ModelSource:
    """Resolve the causal-LM class and its config class: the repo's own code (auto_map) or
    transformers' auto mappings."""
    check_servable(config, model_dir)
    native_note = None
    if config.get("auto_map"):
        native = None if trust_remote_code else auto_map_served_natively(config)
        if native is None:
            return locate_remote_source(config, model_dir, trust_remote_code)
        native_note = native

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    arch_name = architectures[0] if architectures else model_type
    if not model_type:
        raise InputError("config.json has no 'model_type'; it is not a transformers checkpoint")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is unknown to transformers {transformers.__version__}; "
            "upgrade transformers, or pass --trust-remote-code if the repo ships its own code")
    if is_image_text(config) and not native_note and any(isinstance(config.get(key), dict) for key in TEXT_DECODER_KEYS) \
            and not _names_a_text_only_class(architectures):
        return text_decoder_source(config, arch_name)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    # Prefer the checkpoint's own causal-LM class when transformers knows it.
    for arch in architectures:
        if arch.endswith(CAUSAL_LM_SUFFIXES) and hasattr(transformers, arch):
            class_name = arch
            break
    if not class_name:
        no_class = f"transformers {transformers.__version__} has no causal-LM class for model_type '{model_type}'"
        if is_image_text(config):
            raise _refuse(arch_name, image_text_reason(config, no_class))
        raise _refuse(arch_name, f"model_type '{model_type}' has no causal-LM head in transformers "
                                 "(encoder-only, vision/audio-only or similar)")
    model_cls = getattr(transformers, class_name)
    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    modeling_file = Path(inspect.getsourcefile(model_cls))
    reason = refusal_reason(config, model_cls)
    if reason:
        raise _refuse(arch_name, reason)
    return ModelSource(
        model_type=model_type,
        architecture=arch_name,
        model_class=model_cls.__name__,
        config_class=config_cls.__name__,
        modeling_module=model_cls.__module__,
        configuration_module=config_cls.__module__,
        modeling_file=modeling_file,
        configuration_file=Path(inspect.getsourcefile(config_cls)),
        origin=f"transformers {transformers.__version__}",
        attn_implementation="sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager",
        note=native_note,
    )


def _names_a_text_only_class(architectures: list) -> bool:
    """A checkpoint of a multimodal family saved by its text-only causal-LM class (Qwen3_5ForCausalLM): served as
    that class, not by the image-text route."""
    import transformers

    for arch in architectures:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.endswith(CAUSAL_LM_SUFFIXES) else None
        if cls is not None:
            try:
                params = set(inspect.signature(cls.forward).parameters)
            except (TypeError, ValueError):
                continue
            if not params.intersection(IMAGE_INPUTS):
                return True
    return False


def text_decoder_source(config: dict, arch_name: str) -> ModelSource:
    """An image-text checkpoint, served by its text decoder written natively (agent.recipe.text_decoder): the
    decoder's causal-LM class and its own config class (which reads config.json's text_config: transformers finds
    the part of its model_type); refused in one line where the decoder is not written natively (the adapter
    would run the image-text checkpoint's names through a causal LM's code)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from agent.recipe.text_decoder import NotServedByText, text_decoder
    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    try:
        decoder = text_decoder(config)
        derive(config)
    except NotServedByText as exc:
        raise _refuse(arch_name, image_text_reason(config, str(exc))) from None
    except NotNative as exc:
        why = " ".join(exc.reason.split())[:200]
        raise _refuse(arch_name, image_text_reason(config, f"its text decoder is not written natively: {exc.kind}: "
                                                           f"{why}")) from None
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[decoder.causal_lm_type])
    config_cls = type(transformers.AutoConfig.for_model(decoder.text_type))
    return ModelSource(
        model_type=decoder.causal_lm_type, architecture=arch_name, model_class=model_cls.__name__,
        config_class=config_cls.__name__, modeling_module=model_cls.__module__,
        configuration_module=config_cls.__module__, modeling_file=Path(inspect.getsourcefile(model_cls)),
        configuration_file=Path(inspect.getsourcefile(config_cls)), origin=f"transformers {transformers.__version__}",
        attn_implementation="sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager",
        text_decoder_note=f"image-text model {decoder.note()}")


def runs_remote_code(config: dict, trust_remote_code: bool) -> bool:
    """Whether the checkpoint's implementation is the repo's own code: an auto_map, and either the user chose
    it (--trust-remote-code) or transformers does not implement the class it names. Every place that loads
    the original implementation (vendoring, the precision and parity checks) asks this."""
    return bool(config.get("auto_map")) and (trust_remote_code or auto_map_served_natively(config) is None)


def auto_map_served_natively(config: dict) -> str | None:
    """A repo whose auto_map names a class transformers implements itself (DeepSeek-V3's
    DeepseekV3ForCausalLM, Phi-3.5's Phi3ForCausalLM) is served by transformers' class, as vLLM serves the
    architectures it registers: the one line that says so, or None (the repo's own code is needed). The
    auto_map's config class must be the config class transformers has for the config's model_type, and its
    causal-LM class that type's; nothing of the repo is read or run to decide."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto_map = config.get("auto_map") or {}
    model_ref, config_ref = auto_map.get("AutoModelForCausalLM"), auto_map.get("AutoConfig")
    if not isinstance(model_ref, str) or not isinstance(config_ref, str) or "--" in model_ref + config_ref:
        return None
    model_type = config.get("model_type")
    model_class, config_class = model_ref.rpartition(".")[2], config_ref.rpartition(".")[2]
    if CONFIG_MAPPING_NAMES.get(model_type) != config_class or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) != model_class:
        return None
    return (f"the repo's auto_map names {model_class}, which transformers implements ({model_type}): served by "
            f"transformers' own class, the repo's {model_ref.rpartition('.')[0]}.py is not used "
            "(--trust-remote-code uses it)")


from agent.provenance import REMOTE_PACKAGE   # the pseudo package the repo's relative imports resolve against


def locate_remote_source(config: dict, model_dir: Path | None, trust_remote_code: bool) -> ModelSource:
    """auto_map models: the repo's own modeling/configuration files, never imported here."""
    auto_map = config["auto_map"]
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    if isinstance(auto_map, dict) and not auto_map.get("AutoModelForCausalLM") and \
            isinstance(config.get("vision_config"), dict):
        # refused whatever --trust-remote-code says: advice to pass it would only lead here again
        raise _refuse(arch, image_text_reason(config, "its auto_map names no AutoModelForCausalLM"))
    if not trust_remote_code:
        raise UnsupportedModelError(
            f"{arch} ships its own code (auto_map in config.json); review it, then re-run with "
            "--trust-remote-code to vendor it")
    model_ref = auto_map.get("AutoModelForCausalLM")
    config_ref = auto_map.get("AutoConfig")
    if not model_ref or not config_ref:
        raise _refuse(arch, "auto_map has no AutoModelForCausalLM/AutoConfig entry")
    if "--" in model_ref or "--" in config_ref:
        raise _refuse(arch, "auto_map points at code in another repository; download it next to the model")
    model_module, _, model_class = model_ref.rpartition(".")
    config_module, _, config_class = config_ref.rpartition(".")
    for ref, module, cls in ((model_ref, model_module, model_class), (config_ref, config_module, config_class)):
        # Only 'module.Class' with plain names: no '..', no '/', no absolute paths out of the repo.
        if not (is_identifier(module) and is_identifier(cls)):
            raise InputError(f"auto_map entry {ref!r} is not 'module.ClassName' naming a .py file of the "
                             "model repo; only files inside the repo are vendored")
    files = {m: repo_file(model_dir, f"{m}.py") for m in (model_module, config_module)}
    return ModelSource(
        model_type=config.get("model_type", "custom"),
        architecture=arch,
        model_class=model_class,
        config_class=config_class,
        modeling_module=f"{REMOTE_PACKAGE}.{model_module}",
        configuration_module=f"{REMOTE_PACKAGE}.{config_module}",
        modeling_file=files[model_module],
        configuration_file=files[config_module],
        origin=f"remote code in {model_dir}",
        attn_implementation="sdpa" if "_supports_sdpa = True" in files[model_module].read_text() else "eager",
    )


def from_tree(source: ModelSource, tree) -> ModelSource:
    """`source` (located with the installed transformers) read from another release's source tree
    (agent.migrate.transformers_source.SourceTree): the same modules, that release's files."""
    from agent.migrate.transformers_range import needed_version

    if source.modeling_module.startswith(REMOTE_PACKAGE + "."):
        return source       # the model repo's own code: the same files whatever transformers
    row = needed_version(source.model_type, tree.version)
    if row is not None:
        raise UnsupportedModelError(f"model_type {source.model_type!r} needs transformers >= {row.version} "
                                    f"({row.why} before that); the recipe's transformers is {tree.version}")
    files = {}
    for module, cls in ((source.modeling_module, source.model_class), (source.configuration_module, source.config_class)):
        path = tree.module_file(module)
        if path is None or not re.search(rf"^class {re.escape(cls)}\b", path.read_text(), re.M):
            raise UnsupportedModelError(f"{source.architecture}: transformers {tree.version} has no {cls} in {module}; "
                                        f"migrate it for a transformers that has it (--transformers-source)")
        files[module] = path
    return replace(source, modeling_file=files[source.modeling_module],
                   configuration_file=files[source.configuration_module], origin=f"transformers {tree.version}")


def repo_file(repo: Path, name: str) -> Path:
    """A .py file of a remote-code repo, refused unless it is a regular file inside the repo (a
    symlink may point elsewhere in the repo, never out of it)."""
    path = repo / name
    if not path.is_file():
        raise InputError(f"{path}: named in auto_map but missing from the model directory")
    try:
        path.resolve().relative_to(repo.resolve())
    except ValueError:
        raise InputError(f"{path}: resolves outside the model directory ({path.resolve()}); only files "
                         "inside the repo are vendored") from None
    return path


def local_modules(source: ModelSource) -> dict[str, Path]:
    """Other modules of a remote-code repo that the vendored files import relatively (transitively)."""
    if not source.modeling_module.startswith(REMOTE_PACKAGE + "."):
        return {}
    repo = source.modeling_file.parent
    found: dict[str, Path] = {}
    queue = [source.modeling_file, source.configuration_file]
    while queue:
        text = queue.pop().read_text()
        for name in re.findall(r"^\s*from \.(\w+) import", text, re.M):
            path = repo / f"{name}.py"
            module = f"{REMOTE_PACKAGE}.{name}"
            if path.is_file() and module not in found:
                path = repo_file(repo, f"{name}.py")
            if path.is_file() and module not in found and module not in (source.modeling_module,
                                                                          source.configuration_module):
                found[module] = path
                queue.append(path)
    return found


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


# The vendoring codemods in order (agent/codemods/commands/); a configuration file skips the torch_npu guard.
def vendoring_commands(package: str, siblings: dict[str, str], runs_model: bool) -> list[Command]:
    return [command(AbsoluteImportsCommand, package=package, sibling_modules=siblings),
            RunnerSettingsInitCommand,
            *([command(TorchNpuImportGuardCommand, ensure=True)] if runs_model else []),
            RemoveGradientCheckpointingCommand,
            RemoveLabelsLossCommand,
            TransformersInitWeightsCommand]


def apply_codemods(source: str, package: str, siblings: dict[str, str], runs_model: bool = True) -> tuple[str, list[str]]:
    """The vendoring codemods on one file: (new code, names of the commands that changed it)."""
    applied: list[str] = []
    return transform(source, vendoring_commands(package, siblings, runs_model), applied=applied), applied


CODEMOD_FILES = sorted((Path(__file__).resolve().parents[1] / "codemods").rglob("*.py"))


@dataclass
class Planned:
    role: str               # "modeling" | "configuration" | module name (a local module) | "dependency"
    path: Path              # the source file
    stem: str               # the file name under models/
    roots: list[str]        # the definitions kept when pruning ([]: no pruning)


def plan_closure(source: ModelSource, model_name: str, package: str = "models",
                 module_file: Callable[[str], Path | None] | None = None) -> tuple[dict[str, Planned], dict[str, tuple[str, list[str]]]]:
    """Every module to vendor, with its code after the codemods: the model's modeling and
    configuration modules, the repo's local modules, and every `transformers.models.<model>.<module>`
    what is vendored still imports (another model's configuration, a shared module of the family).
    `module_file`: where a transformers module's source is (default: the installed transformers)."""
    module_file = module_file or _module_file
    plan = {source.modeling_module: Planned("modeling", source.modeling_file, f"modeling_{model_name}",
                                            [source.model_class])}
    plan.setdefault(source.configuration_module, Planned("configuration", source.configuration_file,
                                                         f"configuration_{model_name}", []))
    reserved = {"model_setting", "__init__", *(p.stem for p in plan.values())}
    for module, path in local_modules(source).items():
        stem = module.rpartition(".")[2]
        if stem in reserved:
            raise UnsupportedModelError(f"the model repo's module {stem}.py would overwrite the recipe's own "
                                        f"models/{stem}.py; rename it in a copy of the repo (and its imports)")
        plan[module] = Planned(module, path, stem, [])
    siblings = {module: f"{package}.{p.stem}" for module, p in plan.items()}
    processed: dict[str, tuple[str, list[str]]] = {}
    queue = list(plan)
    while queue:
        module = queue.pop(0)
        planned = plan[module]
        # torch_npu is imported where the model runs; configuration files don't need it.
        runs_model = planned.role == "modeling" or (planned.role == "dependency" and planned.stem.startswith("modeling"))
        package = module.rpartition(".")[0]
        # Cached on disk: the same source with the same codemods gives the same code.
        code, applied = codemod_cache.cached(
            lambda: apply_codemods(planned.path.read_text(), package, siblings, runs_model),
            [planned.path.read_text(), package, json.dumps(siblings, sort_keys=True), str(runs_model)], CODEMOD_FILES)
        if find_model_class_imports(code) and planned.roots:
            # Files that also hold multimodal or task classes (e.g. Gemma3ForConditionalGeneration)
            # import AutoModel & co: keep only what the classes the recipe uses reach.
            code = prune_unreachable(code, roots=planned.roots)
            applied.append(PruneUnreachableDefinitionsCommand.__name__)
        processed[module] = (code, applied)
        for dep, names in transformers_model_imports(code).items():
            dep_file = module_file(dep) if dep not in plan else None
            if dep_file is None:
                continue  # vendored already, or not importable here: the contract check names it
            leaf = dep.rpartition(".")[2]
            dep_stem = leaf if leaf not in {p.stem for p in plan.values()} else f"{dep.split('.')[2]}_{leaf}"
            defined = _module_level_definitions(dep_file)
            plan[dep] = Planned("dependency", dep_file, dep_stem, [n for n in names if n in defined])
            siblings[dep] = f"{package}.{dep_stem}"
            queue.append(dep)
    return plan, processed


def vendor_source(source: ModelSource, recipe_dir: Path, model_name: str, package: str = "models",
                  tree=None, model_source: str | None = None, model_dir: Path | None = None) -> VendorResult:
    """Copy modeling + configuration source into recipe_dir/models and apply the codemods.

    The copy is closed under imports (`plan_closure`) and the imports are pointed at the copies
    (`package`: the copies' package as the recipe runs them, `models` for a recipe on sys.path,
    `models.NAME.models` in a cann-recipes-infer checkout); only the auto registry
    (`transformers.models.auto`) stays a transformers import. `tree`: another release's source
    (agent.migrate.transformers_source.SourceTree) to copy from instead of the installed one's.

    Every file written here goes through `finish_file`: its header names the exact source
    (agent.provenance: the transformers release and file, or the hub repository and revision
    `model_source` / `model_dir` say), the source's copyright lines and licence, and no line ends in
    whitespace (upstream's pre-commit hooks).
    """
    if tree is not None:
        source = from_tree(source, tree)
    plan, processed = plan_closure(source, model_name, package, tree.module_file if tree is not None else None)
    siblings = {module: f"{package}.{p.stem}" for module, p in plan.items()}
    models_dir = recipe_dir / "models"
    recipe_tree = user_tree(recipe_dir, create=True)
    recipe_tree.mkdir(models_dir)
    result = VendorResult(source=source)
    for module, planned in plan.items():
        code, applied = processed[module]
        more: list[str] = []
        code = transform(code, [command(VendoredImportsCommand, vendored=siblings)], applied=more)
        code = finish_file(code, module, planned.path, source, tree, applied + more, model_source, model_dir)
        offending = find_model_class_imports(code)
        if offending:
            raise VendorError(
                f"vendored {planned.stem}.py still imports model or configuration classes from transformers "
                f"({', '.join(offending)}); vendor those modules too or report this architecture")
        out = models_dir / f"{planned.stem}.py"
        recipe_tree.write_text(out, code)

        result.files[planned.role if planned.role in ("modeling", "configuration") else module] = out
        result.codemods[out.name] = applied + more
    return result


def transformers_version_of(source: ModelSource, tree=None) -> str | None:
    """The transformers release the files are copied from."""
    if tree is not None:
        return tree.version
    return source.origin.removeprefix("transformers ") if source.origin.startswith("transformers ") else None


def finish_file(code: str, module: str, path: Path, source: ModelSource, tree, applied: list[str],
                model_source: str | None = None, model_dir: Path | None = None) -> str:
    """The last step of every vendored file: its provenance header (SourceHeaderCommand), then no
    whitespace at a line's end (BlankLineWhitespaceCommand)."""
    prov = provenance.of_module(module, path, transformers_version_of(source, tree), model_source, model_dir)
    edits = ", ".join(name.removesuffix("Command") for name in applied) or "none"
    what = f"Vendored copy for cann-recipes-infer, rewritten by codemods: {edits}."
    header = provenance.header_lines(prov, what)
    return transform(code, [command(SourceHeaderCommand, header=header), BlankLineWhitespaceCommand])


def _module_level_definitions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def prune_unreachable(code: str, roots: list[str]) -> str:
    return transform(code, [command(PruneUnreachableDefinitionsCommand, roots=roots)])


def _is_model_class_object(obj: object) -> bool:
    import torch
    from transformers import PreTrainedConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    # Auto classes are not modules but build model classes, so they count as model classes too;
    # a configuration class of another model is part of that model's implementation as well.
    return isinstance(obj, type) and issubclass(obj, (torch.nn.Module, _BaseAutoModelClass, PreTrainedConfig))


def find_model_class_imports(source: str) -> list[str]:
    """Return "module.Name" for each model or configuration class imported from a
    `transformers.models.*` module (anywhere in the file, also inside functions)."""
    found: list[str] = []
    for node in m.findall(cst.parse_module(source), m.ImportFrom(relative=[])):
        module = dotted(node.module)
        if not module.startswith("transformers.models.") or isinstance(node.names, cst.ImportStar):
            continue
        try:
            imported = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - missing optional dependency, broken module, ...
            continue  # cannot be resolved here; the import check of the recipe will report it
        for alias in node.names:
            name = dotted(alias.name)
            qualified = f"{module}.{name}"
            if _is_model_class_object(getattr(imported, name, None)) and qualified not in found:
                found.append(qualified)
    return found


def transformers_model_imports(source: str) -> dict[str, list[str]]:
    """Modules of model implementations a file imports absolutely, with the names it takes.

    ``{"transformers.models.llama.configuration_llama": ["LlamaConfig"]}``: every
    `from transformers.models.<model>.<module> import ...` anywhere in the file, except the auto
    registry (`transformers.models.auto.*`), which maps names to classes and is no model's code.
    """
    found: dict[str, list[str]] = {}
    for node in m.findall(cst.parse_module(source), m.ImportFrom(relative=[])):
        module = dotted(node.module)
        parts = module.split(".")
        if len(parts) < 4 or parts[:2] != ["transformers", "models"] or parts[2] == "auto":
            continue
        names = found.setdefault(module, [])
        if not isinstance(node.names, cst.ImportStar):
            names.extend(dotted(a.name) for a in node.names if dotted(a.name) not in names)
    return found
