"""Vendor a checkpoint's modeling and configuration source into a recipe.

The source is located through transformers' own auto mappings and the class's source file (never
by guessing file names), copied to `{recipe}/models/`, and rewritten by the codemods in
`agent.codemods`. Afterwards the code must not import any model class from transformers.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import InputError, UnsupportedModelError, VendorError
from agent.routing import supported_families


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


@dataclass
class VendorResult:
    source: ModelSource
    files: dict[str, Path] = field(default_factory=dict)   # role -> written file
    codemods: dict[str, list[str]] = field(default_factory=dict)  # file name -> codemods applied


def read_config(model_dir: Path) -> dict:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir}: no config.json — point at a Hugging Face model directory "
                         "(the folder that holds config.json and the weights)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_file}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc


def locate_source(config: dict) -> ModelSource:
    """Resolve the causal-LM class and its config class through transformers' auto mappings."""
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
    if config.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"{arch_name} is an encoder-decoder model; only decoder-only causal LMs can be served "
            f"(families: {supported_families()})")
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    # Prefer the checkpoint's own causal-LM class when transformers knows it.
    for arch in architectures:
        if arch.endswith("ForCausalLM") and hasattr(transformers, arch):
            class_name = arch
            break
    if not class_name:
        raise UnsupportedModelError(
            f"{arch_name} ({model_type}) has no causal-LM head in transformers (encoder-only, "
            f"vision/audio-only or similar); supported: decoder-only families {supported_families()}")
    model_cls = getattr(transformers, class_name)
    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    return ModelSource(
        model_type=model_type,
        architecture=arch_name,
        model_class=model_cls.__name__,
        config_class=config_cls.__name__,
        modeling_module=model_cls.__module__,
        configuration_module=config_cls.__module__,
        modeling_file=Path(inspect.getsourcefile(model_cls)),
        configuration_file=Path(inspect.getsourcefile(config_cls)),
        origin=f"transformers {transformers.__version__}",
    )


def vendor_source(source: ModelSource, recipe_dir: Path, model_name: str) -> VendorResult:
    """Copy modeling + configuration source into recipe_dir/models and apply the codemods."""
    from agent.codemods import apply_codemods, find_model_class_imports

    models_dir = recipe_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    targets = {
        "modeling": (source.modeling_module, source.modeling_file, f"modeling_{model_name}"),
        "configuration": (source.configuration_module, source.configuration_file,
                          f"configuration_{model_name}"),
    }
    siblings = {module: f"models.{stem}" for module, _, stem in targets.values()}
    result = VendorResult(source=source)
    for role, (module, path, stem) in targets.items():
        package = module.rpartition(".")[0]
        code, applied = apply_codemods(path.read_text(), package=package, sibling_modules=siblings)
        offending = find_model_class_imports(code)
        if offending:
            raise VendorError(
                f"vendored {stem}.py still imports model classes from transformers "
                f"({', '.join(offending)}); vendor those modules too or report this architecture")
        out = models_dir / f"{stem}.py"
        out.write_text(code)
        result.files[role] = out
        result.codemods[out.name] = applied
    return result
