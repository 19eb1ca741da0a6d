"""The recipe spec: every value a recipe's files are rendered from, built once.

`RecipeSpec.for_checkpoint` builds it when migrating (node_render); `RecipeSpec.from_recipe` rebuilds
it from an existing recipe's report, YAML and checkpoint when a repair re-renders a file or needs a
YAML default (agent.repair.recipe_spec gathers those). `context()` is the template context, `settings()` the YAML (engine/config.py's schema).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from agent.recipe.parallel import parallel_settings
from agent.recipe.routing import FAMILIES, Family, route
from engine import defaults
from engine.config import KEY, KEYS, rendered_settings

DTYPES = KEY["model_config.dtype"].choices
VENDORED_KEYS = ("model_class", "config_class", "modeling_module", "configuration_module", "origin",
                 "attn_implementation")


def checkpoint_dtype(config: dict) -> str:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype if dtype in DTYPES else "float32"


def position_limit(config: dict) -> int | None:
    """The model's position limit; None when it has none (xlnet says max_position_embeddings -1)."""
    text = config.get("text_config") or config
    limit = text.get("max_position_embeddings") or text.get("n_positions") or text.get("max_sequence_length")
    return limit if isinstance(limit, int) and limit > 0 else None


def input_max_len(config: dict, max_new_tokens: int, default: int = defaults.INPUT_MAX_LEN) -> int:
    """Prompt budget: 1024 tokens, less when the model has fewer positions."""
    limit = position_limit(config)
    return max(1, min(default, limit - max_new_tokens)) if limit else default


def valid_setting(settings: dict, dotted: str):
    """The YAML's value for a schema key when it passes validation (type, choices, >= 1), else None."""
    key = KEY[dotted]
    parent = settings if key.section is None else settings.get(key.section)
    value = parent.get(key.leaf) if isinstance(parent, dict) else None
    if not isinstance(value, key.kind) or (key.kind is int and (isinstance(value, bool) or value < 1)):
        return None
    return None if key.choices and value not in key.choices else value


@dataclass(frozen=True)
class RecipeSpec:
    model_name: str
    model_path: str
    model_source: str
    architecture: str
    family: str                             # a key of agent.recipe.routing.FAMILIES
    dtype: str
    input_max_len: int
    max_new_tokens: int
    attn_implementation: str = KEY["model_config.attn_implementation"].default
    device: str = KEY["device"].default
    world_size: int = defaults.WORLD_SIZE
    attn_tp_size: int = 1
    moe_tp_size: int = 1
    lmhead_tp_size: int = 1
    # the vendored classes; None when a damaged recipe no longer says (templates needing them refuse)
    model_class: str | None = None
    config_class: str | None = None
    modeling_module: str | None = None
    configuration_module: str | None = None
    origin: str = "unknown origin"
    transformers_version: str = ""
    modeling_codemods: tuple[str, ...] = ()

    def context(self) -> dict:
        """The template context (agent/recipe/render.py adds the derived names and the YAML settings)."""
        ctx = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        ctx["modeling_codemods"] = ", ".join(self.modeling_codemods) or "none"
        return ctx

    def family_spec(self) -> Family:
        return FAMILIES[self.family]

    def settings(self) -> dict:
        """The recipe YAML as data, in schema order."""
        return rendered_settings(self.context())

    @classmethod
    def for_checkpoint(cls, *, model_name: str, model_dir: Path, model_source: str, architecture: str,
                       family: str, vendored: dict, config: dict, device: str = "auto", dtype: str | None = None,
                       max_new_tokens: int | None = None, world_size: int | None = None) -> RecipeSpec:
        """The spec of a new recipe: the options given, else what the checkpoint says, else the defaults.
        Refuses world_size > 1 for a family without a tensor-parallel plan."""
        import transformers

        max_new = max_new_tokens or defaults.MAX_NEW_TOKENS
        codemods = (vendored.get("codemods") or {}).get(f"modeling_{model_name}.py", [])
        return cls(model_name=model_name, model_path=str(Path(model_dir).resolve()), model_source=model_source,
                   architecture=architecture, family=family, device=device or "auto",
                   dtype=dtype or checkpoint_dtype(config), input_max_len=input_max_len(config, max_new),
                   max_new_tokens=max_new,
                   transformers_version=vendored.get("transformers_version") or transformers.__version__,
                   modeling_codemods=tuple(codemods), **{k: vendored[k] for k in VENDORED_KEYS},
                   # world_size, attn_tp_size, moe_tp_size, lmhead_tp_size
                   **parallel_settings(config, world_size or defaults.WORLD_SIZE))

    @classmethod
    def from_recipe(cls, *, model_name: str, report: dict, settings: dict, model_dir: Path | None, config: dict,
                    vendored: dict) -> RecipeSpec:
        """The spec of an existing recipe, from its migration_report.json (`report`), its YAML
        (`settings`: values that validate are kept), its checkpoint (`model_dir`, `config`: {} when
        gone) and the vendored classes known. What none of them says gets the migration's default."""
        import transformers

        def kept(dotted):
            return valid_setting(settings, dotted)

        device = kept("device") or KEY["device"].default
        env_device = (report.get("env") or {}).get("device")
        on_cpu = device == "cpu" or (device == "auto" and env_device in (None, "cpu"))
        limit = position_limit(config)
        max_new = kept("data_config.max_new_tokens")
        if max_new is None:     # what fits beside the prompt budget the YAML keeps
            prompt = kept("data_config.input_max_len")
            max_new = max(1, min(defaults.MAX_NEW_TOKENS, limit - prompt)) if limit and prompt \
                else defaults.MAX_NEW_TOKENS
        family = report.get("family") or (route(config.get("text_config") or config).name if config
                                          else "standard")
        written_path = settings.get("model_path")      # kept when the checkpoint is gone
        return cls(
            model_name=model_name,
            model_path=str(model_dir.resolve()) if model_dir else (written_path if isinstance(written_path, str) else ""),
            model_source=report.get("model_source") or kept("model_source") or (str(model_dir) if model_dir else ""),
            architecture=report.get("architecture") or ((config.get("architectures") or [None])[0])
            or vendored.get("model_class", model_name),
            family=family if family in FAMILIES else "standard",
            device=device,
            dtype=kept("model_config.dtype") or ("float32" if on_cpu else checkpoint_dtype(config)),
            input_max_len=kept("data_config.input_max_len") or input_max_len(config, max_new),
            max_new_tokens=max_new,
            attn_implementation=kept("model_config.attn_implementation") or vendored.get("attn_implementation")
            or KEY["model_config.attn_implementation"].default,
            origin=vendored.get("origin") or "unknown origin",
            transformers_version=vendored.get("transformers_version") or transformers.__version__,
            modeling_codemods=tuple((vendored.get("codemods") or {}).get(f"modeling_{model_name}.py", [])),
            **{k: vendored.get(k) for k in ("model_class", "config_class", "modeling_module", "configuration_module")},
        )

    def yaml_defaults(self) -> dict:
        """{dotted key: value} for every schema key this spec gives a value (repair's YAML defaults)."""
        settings = self.settings()
        flat = {}
        for key in KEYS:
            parent = settings if key.section is None else settings.get(key.section, {})
            value = parent.get(key.leaf)
            if not key.is_section and value not in (None, ""):
                flat[key.name] = value
        return flat
