"""Upstream's new-model checklist (docs/common/new_model_checklist.md) as checks of a framework recipe.

`check_recipe(recipe_dir)` runs every item a program can check on the recipe's files (nothing is
run, imported or executed): {item id: [problem, ...]}, an empty list where the item holds. The ids
are the checklist's section and point ("一.1.yaml_keys"). What needs a run (packed batches, the
npugraph_ex compile-once, parity) is checked by the tests that run recipes under the stand-in; what
needs an NPU, a data set or a person's judgement is in PERSON.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path
from typing import Callable


from agent.recipe import requirements, upstream_schema
from agent.recipe.targets import dotted
from agent.recipe.registry import _specs_dict
from engine.safe_load import load_yaml

REGISTRY = Path("executor") / "core" / "support_models.py"
# 一.1: the YAML keys the checklist names (the tp sizes "by the split": at least attn and lmhead)
YAML_KEYS = ("model_config.model_name", "model_config.model_path", "model_config.exe_mode",
             "data_config.input_truncated_len", "scheduler_config.batch_size", "scheduler_config.max_new_tokens",
             "scheduler_config.max_prefill_tokens", "parallel_config.world_size", "parallel_config.attn_tp_size",
             "parallel_config.lmhead_tp_size")
# 二.2: the framework's own environment variables a model may read
FRAMEWORK_ENV = {"CANN_RECIPES_LOG_LEVEL", "LOCAL_RANK", "RANK", "WORLD_SIZE", "RANK_ID", "LOCAL_WORLD_SIZE"}
README_SECTIONS = ("## 环境准备", "## 权重准备", "## 推理执行")
PLACEHOLDER = re.compile(r"^(your_|<|\$\{?|/path/to)", re.I)
LICENSE = re.compile(r"Licensed under|SPDX-License-Identifier|Apache License|MIT License", re.I)

# Items no program here can check on the files: (id, what is left to a person).
PERSON = (
    ("一.1.environment", "function and precision on the README's declared environment (CANN, torch_npu, an NPU)"),
    ("一.3.packed_sequence", "batch_size_per_dp_rank > 1 with unequal lengths on an NPU (the stand-in runs check "
                             "it on CPU: tests/e2e/test_framework_target.py)"),
    ("一.4.npugraph_ex_compile", "the warm-up compile and no recompile in the formal decode on an NPU (the "
                                 "stand-in's compile-once check: tests/e2e/test_framework_target.py)"),
    ("一.5.online", "online serving (recommended): the prefill/decode/router full-link run (its KV hand-off "
                    "writes into the decode role's NPU memory: an NPU)"),
    ("一.6.dataset_score", "a data-set score (recommended), e.g. GSM8K through evalscope on the online service"),
    ("二.3.readme_reproducible", "the README's steps reproduce the run for another developer"),
    ("二.3.docs_refreshed", "user-facing changes reflected in the docs"),
    ("二.5.quant_docs", "quantisation types and their weight-conversion scripts (none for a BF16 checkpoint)"),
    ("二.7.public_code_compatible", "a change of the public framework code is compatible with every model"),
)


class Recipe:
    """The files of one framework recipe in its checkout, read once."""

    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        self.name = self.path.name
        self.checkout = self.path.parent.parent
        self.yamls = {p: load_yaml(p) for p in sorted((self.path / "config").glob("*.yaml"))}
        self.readme = (self.path / "README.md").read_text(encoding="utf-8") if (self.path / "README.md").is_file() else ""
        self.python = {p: p.read_text(encoding="utf-8") for p in sorted(self.path.rglob("*.py"))
                       if "res" not in p.relative_to(self.path).parts}

    def registry_entry(self) -> list[tuple[str, str]]:
        specs = _specs_dict(ast.parse((self.checkout / REGISTRY).read_bytes()))
        for key, value in zip(specs.keys, specs.values) if specs else ():
            if isinstance(key, ast.Constant) and key.value == self.name and isinstance(value, ast.List):
                return [tuple(elt.value for elt in item.elts) for item in value.elts if isinstance(item, ast.Tuple)]
        return []


def _leaf(settings: dict, key: str):
    return dotted(settings, key, KeyError)


def _flat(settings, prefix=""):
    if isinstance(settings, dict):
        for key, value in settings.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], settings


def basic_files(r: Recipe) -> list[str]:
    out = []
    if not list((r.path / "models").glob("modeling_*.py")):
        out.append("no models/modeling_*.py (the model implementation)")
    if not list((r.path / "models").glob("configuration_*.py")):
        out.append("no models/configuration_*.py (the configuration class)")
    if not r.readme:
        out.append("no README.md")
    if not r.yamls:
        out.append("no config/*.yaml")
    return out


def yaml_keys(r: Recipe) -> list[str]:
    return [f"{p.name}: no {key}" for p, s in r.yamls.items() for key in YAML_KEYS if _leaf(s, key) is KeyError]


def interface_contract(r: Recipe) -> list[str]:
    """The registry's entry imports classes the recipe defines; the model class has the contract's methods."""
    entry = r.registry_entry()
    if not entry:
        return [f"{REGISTRY} has no entry {r.name!r}"]
    out = []
    for module, cls in entry:
        file = r.checkout.joinpath(*module.split(".")).with_suffix(".py")
        if not file.is_file() or r.path not in file.parents:
            out.append(f"registry module {module} is not a file of the recipe")
            continue
        classes = {n.name: n for n in ast.walk(ast.parse(file.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef)}
        if cls not in classes:
            out.append(f"{file.name} defines no class {cls}")
        elif cls.endswith("ForCausalLM"):
            methods = {n.name for n in classes[cls].body if isinstance(n, ast.FunctionDef)}
            out += [f"{cls} has no {m}()" for m in ("forward", "load_weights") if m not in methods]
    return out


def kv_cache(r: Recipe) -> list[str]:
    """KVCacheManager (the framework's cache: the model declares get_cache_info) or a model-kept cache."""
    entry = r.registry_entry()
    text = "".join(r.python.get(r.checkout.joinpath(*m.split(".")).with_suffix(".py"), "") for m, _ in entry)
    return [] if re.search(r"def get_cache_info\(", text) else ["the model declares no get_cache_info() (KVCacheManager)"]


def npugraph_ex_yaml(r: Recipe) -> list[str]:
    modes = {_leaf(s, "model_config.exe_mode") for s in r.yamls.values()}
    return [] if "npugraph_ex" in modes else [f"no YAML with model_config.exe_mode: npugraph_ex (modes: {sorted(map(str, modes))})"]


PD_ROLES = ("prefill", "decode")


def pd_yamls(r: Recipe) -> list[str]:
    """The online prefill / decode pair infer.sh --mode online reads by default: config/<name>_pd/{role}.yaml,
    each with the checklist's keys, the recipe's model_name and a placeholder model_path."""
    out = []
    for role in PD_ROLES:
        path = r.path / "config" / f"{r.name}_pd" / f"{role}.yaml"
        if not path.is_file():
            out.append(f"no config/{r.name}_pd/{role}.yaml")
            continue
        settings = load_yaml(path)
        settings = settings if isinstance(settings, dict) else {}
        out += [f"{r.name}_pd/{role}.yaml: no {key}" for key in YAML_KEYS if _leaf(settings, key) is KeyError]
        if _leaf(settings, "model_config.model_name") not in (KeyError, r.name):
            out.append(f"{r.name}_pd/{role}.yaml: model_name is not {r.name!r}")
    return out


def mtp(r: Recipe) -> list[str]:
    """MTP: a registered ModelMTP class needs a YAML that enables it (none registered: not applicable)."""
    if not any(cls.endswith("MTP") for _, cls in r.registry_entry()):
        return []
    return [] if any(_leaf(s, "model_config.next_n") not in (KeyError, 0, None) for s in r.yamls.values()) \
        else ["a ModelMTP class is registered but no YAML sets model_config.next_n"]


def versions(r: Recipe) -> list[str]:
    """The checkout's stack: every package most registered models pin, at their pin (transformers aside:
    the recipe pins the release it is vendored from); nothing else beside what the code imports."""
    stack = requirements.checkout_pins(r.checkout)
    path = r.path / "requirements.txt"
    if not path.is_file():
        return ["no requirements.txt"]
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    pinned = {requirements.canonical(re.split(r"[=<>!~ ]", line, 1)[0]): line for line in lines}
    out = [f"requirements.txt pins {pinned.get(key)!r}, the checkout's models {line!r}"
           for key, line in stack.items() if key != "transformers" and pinned.get(key) != line]
    if not re.fullmatch(r"transformers==[\w.]+", pinned.get("transformers", "")):
        out.append(f"transformers is not pinned to one release: {pinned.get('transformers')!r}")
    imported = requirements.third_party(requirements.executor_imports(r.checkout))
    for text in r.python.values():
        imported |= requirements.third_party({n.split(".")[0] for n in re.findall(r"^\s*(?:import|from)\s+([\w.]+)",
                                                                              text, re.M)})
    known = set(stack) | {requirements.canonical(requirements.DISTRIBUTION.get(m, m)) for m in imported} | \
        {requirements.canonical(requirements._NAME.match(line).group(1)) for _, line in requirements.COMPATIBLE}
    out += [f"requirements.txt adds {line!r}, which neither the stack nor the code needs"
            for key, line in pinned.items() if key not in known]
    return out


def environment_variables(r: Recipe) -> list[str]:
    found = set()
    for text in r.python.values():
        found |= set(re.findall(r"""(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*["']([A-Z0-9_]+)["']""", text))
    return [f"reads {name}, which the README does not explain" for name in sorted(found - FRAMEWORK_ENV)
            if name not in r.readme]


def readme(r: Recipe) -> list[str]:
    return [f"README.md has no '{s}' section" for s in README_SECTIONS if f"\n{s}\n" not in f"\n{r.readme}"]


def custom_params(r: Recipe) -> list[str]:
    """Fields only of upstream's schema; the model's own only under model_config.custom_params, each in the README."""
    schema = upstream_schema.schema(r.checkout) or {}
    out = []
    for p, s in r.yamls.items():
        for section, values in (s or {}).items():
            if section not in schema:
                out.append(f"{p.name}: top-level {section!r} is no section of InferenceConfig")
                continue
            for key in values or {}:
                if key not in schema[section]:
                    out.append(f"{p.name}: {section}.{key} is no field of upstream's schema (custom_params is the place)")
        for key in (_leaf(s, "model_config.custom_params") or {}) if isinstance(_leaf(s, "model_config.custom_params"), dict) else {}:
            if f"`{key}`" not in r.readme and key not in r.readme:
                out.append(f"{p.name}: custom_params.{key} is not explained in README.md")
    return out


def few_yamls(r: Recipe) -> list[str]:
    """No two YAMLs that differ in one switch (one field)."""
    out, items = [], list(r.yamls.items())
    for i, (a, sa) in enumerate(items):
        for b, sb in items[i + 1:]:
            fa, fb = dict(_flat(sa)), dict(_flat(sb))
            diff = sorted(k for k in fa.keys() | fb.keys() if fa.get(k, KeyError) != fb.get(k, KeyError))
            if len(diff) <= 1:
                out.append(f"{a.name} and {b.name} differ only in {diff or 'nothing'}")
    return out


def placeholder_paths(r: Recipe) -> list[str]:
    out = []
    for p, s in r.yamls.items():
        for key, value in _flat(s):
            if key.endswith("_path") and isinstance(value, str) and value and not PLACEHOLDER.match(value):
                out.append(f"{p.name}: {key} is {value!r}, not a placeholder such as your_model_path")
    return out


def quantization(r: Recipe) -> list[str]:
    """Quantisation comes from the checkpoint's config.json: no YAML field or switch of ours for it."""
    return [f"{p.name}: {key} sets quantisation in the YAML" for p, s in r.yamls.items() for key, _ in _flat(s)
            if re.search(r"quant|w8a8|w4a16", key, re.I)]


def naming(r: Recipe) -> list[str]:
    out = [] if re.fullmatch(r"[a-z][a-z0-9_]*", r.name) else [f"folder {r.name!r} is not snake_case"]
    out += [f"{p.name}: model_config.model_name is {_leaf(s, 'model_config.model_name')!r}, not {r.name!r}"
            for p, s in r.yamls.items() if _leaf(s, "model_config.model_name") != r.name]
    docs = r.checkout / "docs" / "models"
    if docs.is_dir() and any(d.name.lower() == r.name.lower() and d.name != r.name for d in docs.iterdir()):
        out.append(f"docs/models/ names the model differently from {r.name!r}")
    return out


def public_code(r: Recipe) -> list[str]:
    """No framework code (outside models/) changed but the registry, and there only lines added (git's view)."""
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=r.checkout,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return []                       # not a git checkout: nothing to compare against
    out = [f"changes {line[3:]}, framework code outside models/" for line in proc.stdout.splitlines()
           if not line[3:].startswith("models/") and line[3:] != REGISTRY.as_posix()]
    diff = subprocess.run(["git", "diff", "-U0", "--", REGISTRY.as_posix()], cwd=r.checkout,
                          capture_output=True, text=True).stdout
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    return out + ([f"{REGISTRY} loses lines: {removed[:3]}"] if removed else [])


def logging_style(r: Recipe) -> list[str]:
    out = []
    for p, text in r.python.items():
        rel = p.relative_to(r.path)
        if re.search(r"\blogging\.basicConfig\(", text):
            out.append(f"{rel} calls logging.basicConfig")
        out += [f"{rel}: logging.getLogger({arg}) (use __name__)"
                for arg in re.findall(r"\blogging\.getLogger\(([^)]*)\)", text) if arg.strip() != "__name__"]
    return out


def license_headers(r: Recipe) -> list[str]:
    out = []
    for p, text in r.python.items():
        head = "\n".join(text.splitlines()[:40])
        if not (LICENSE.search(head) and re.search(r"Copyright", head, re.I)):
            out.append(f"{p.relative_to(r.path)} has no licence header with its copyright")
    return out


ITEMS: dict[str, tuple[str, Callable[[Recipe], list[str]]]] = {
    "一.1.files": ("model implementation, configuration class, README and YAML under models/<name>/", basic_files),
    "一.1.yaml_keys": ("every YAML covers the checklist's keys", yaml_keys),
    "一.1.interface_contract": ("the registry entry imports the recipe's classes, with the contract's methods",
                                interface_contract),
    "一.2.kv_cache": ("the KV cache is the framework's KVCacheManager (get_cache_info)", kv_cache),
    "一.5.pd_yamls": ("config/<name>_pd/prefill.yaml and decode.yaml, the online mode's defaults", pd_yamls),
    "一.4.npugraph_ex_yaml": ("at least one YAML with exe_mode npugraph_ex", npugraph_ex_yaml),
    "一.4.mtp": ("a registered MTP model has a YAML enabling it", mtp),
    "二.1.versions": ("requirements.txt is the checkout's stack; no library beyond what the code imports", versions),
    "二.2.environment_variables": ("no environment variable of its own that the README does not explain",
                                   environment_variables),
    "二.3.readme": ("README.md in the recipe with environment, weights and run sections", readme),
    "二.4.custom_params": ("only upstream's fields; the model's own under custom_params, explained", custom_params),
    "二.4.few_yamls": ("no two YAMLs that differ in one switch", few_yamls),
    "二.4.placeholder_paths": ("paths in the YAMLs are placeholders", placeholder_paths),
    "二.5.quantization": ("quantisation from config.json, no YAML switch", quantization),
    "二.6.naming": ("snake_case name, equal to the folder and model_config.model_name", naming),
    "二.7.public_code": ("no framework code changed outside models/ but lines added to the registry", public_code),
    "二.8.logging": ("logging.getLogger(__name__), no logging.basicConfig", logging_style),
    "二.9.license": ("every Python file carries a licence header and copyright", license_headers),
}


def check_recipe(recipe_dir: Path) -> dict[str, list[str]]:
    recipe = Recipe(recipe_dir)
    return {item: check(recipe) for item, (_, check) in ITEMS.items()}
