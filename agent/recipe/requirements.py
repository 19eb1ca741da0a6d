"""A checkout recipe's requirements.txt: the checkout's own pinned stack (issue #35.3).

cann-recipes-infer's registered models each pin their stack in `models/<folder>/requirements.txt`
(torch==2.8.0, transformers==5.0.0, datasets==3.6.0 ... at fbc225d). A framework or legacy recipe
pins the same: for every package that most registered models pin, the pin most of them write (a
tie: the first folder's, in name order). transformers is the release the recipe is vendored from.
Added to that: what the executor's offline path imports beside the NPU stack (datasets, yaml ...)
and what the vendored modeling code imports, unpinned (a minority's pin can contradict the stack:
models/gpt_oss pins safetensors==0.4.0 beside transformers==5.0.0, which needs >=0.4.3).
Nothing here imports or runs the checkout's code: its files are read as text and parsed.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

REGISTRY = Path("executor") / "core" / "support_models.py"
EXECUTOR_ENTRY = Path("executor") / "offline" / "infer.py"
# The NPU stack comes with CANN (the README's 环境准备), never from pip; and this checkout's own packages.
NOT_FROM_PIP = {"torch_npu", "torchair", "executor", "module", "models", "ops", "torch_bsa", "memfabric_hybrid",
                "mooncake", "offline_profiling"}
# import name -> distribution, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "google": "protobuf", "sklearn": "scikit-learn", "PIL": "pillow",
                "compressed_tensors": "compressed-tensors", "zmq": "pyzmq", "huggingface_hub": "huggingface-hub"}
# Lines a fresh install of the stack needs that no model pins: (when, line). datasets needs pyarrow,
# whose newest releases (26 on) refuse NumPy 1.x at import ("pyarrow requires NumPy 2.0 or newer").
COMPATIBLE = (
    (lambda pins: "datasets" in pins and re.fullmatch(r"numpy==1\.[\d.]+", pins.get("numpy", "")) is not None,
     "pyarrow<26"),
)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_STACK_TORCH = re.compile(r"PyTorch\s+(\d+\.\d+(?:\.\d+)?)", re.IGNORECASE)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def registered_folders(checkout: Path) -> list[Path]:
    """The model folders the checkout's registry imports from (`models.<folder>.…`) that pin a stack."""
    try:
        text = (checkout / REGISTRY).read_text(errors="replace")
    except OSError:
        return []
    names = sorted(set(re.findall(r"[\"']models\.([A-Za-z0-9_]+)\.", text)))
    return [checkout / "models" / n for n in names if (checkout / "models" / n / "requirements.txt").is_file()]


def _lines(path: Path) -> list[str]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-") and _NAME.match(line):
            out.append(line)
    return out


def checkout_pins(checkout: Path) -> dict[str, str]:
    """canonical package name -> the requirement line most registered models write for it, for
    every package that more than half of them pin (in the first folder's order)."""
    folders = registered_folders(checkout)
    per_package: dict[str, Counter] = {}
    for folder in folders:
        seen = set()
        for line in _lines(folder / "requirements.txt"):
            key = canonical(_NAME.match(line).group(1))
            if key not in seen:
                seen.add(key)
                per_package.setdefault(key, Counter())[line.replace(" ", "")] += 1
    return {key: lines.most_common(1)[0][0] for key, lines in per_package.items()
            if sum(lines.values()) * 2 > len(folders)}


def _imports(path: Path, package: str = "") -> tuple[set[str], set[str]]:
    """(top-level third-party candidates, this checkout's modules) that one file imports, anywhere in it
    (every `import` statement); `package`: the file's dotted package, for its relative imports."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return set(), set()
    tops, local = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and package:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            stem = ".".join(base + ([node.module] if node.module else []))
            names = [stem] if node.module else [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("executor", "module"):
                local.add(name)
            else:
                tops.add(name.split(".")[0])
    return tops, local


def _module_file(checkout: Path, dotted: str) -> Path | None:
    base = checkout.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def executor_imports(checkout: Path) -> set[str]:
    """Top-level third-party modules the checkout's offline entry point reaches through its own
    executor/ and module/ imports (read statically)."""
    todo, done, found = [checkout / EXECUTOR_ENTRY], set(), set()
    while todo:
        path = todo.pop()
        if path in done or not path.is_file():
            continue
        done.add(path)
        rel = path.relative_to(checkout).with_suffix("").parts
        tops, local = _imports(path, ".".join(rel[:-1]))
        found |= tops
        for dotted in local:
            parts = dotted.split(".")
            for end in range(len(parts), 0, -1):       # the module, else its package (`from a.b import c`)
                file = _module_file(checkout, ".".join(parts[:end]))
                if file is not None:
                    todo.append(file)
                    if file.name == "__init__.py" or end == len(parts):
                        break
    return found


def third_party(modules: set[str]) -> set[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return {m for m in modules if m not in stdlib and m not in NOT_FROM_PIP and not m.startswith("_")}


def torch_pin(checkout: Path, installed: str) -> str:
    agents = checkout / "AGENTS.md"
    if agents.is_file() and (found := _STACK_TORCH.search(agents.read_text(errors="replace"))):
        return f"torch=={found.group(1)}"
    return f"torch=={installed.split('+')[0]}"


def recipe_requirements(checkout: Path | None, transformers_version: str, vendored: list[Path] = ()) -> list[str]:
    """The requirement lines of a recipe in `checkout`, vendored from transformers==`transformers_version`
    (files `vendored`: the recipe's modeling code, for what it imports beside the stack)."""
    import torch

    pins = checkout_pins(checkout) if checkout is not None else {}
    pins["transformers"] = f"transformers=={transformers_version}"
    if "torch" not in pins:
        pins = {"torch": torch_pin(checkout, torch.__version__) if checkout is not None
                else f"torch=={torch.__version__.split('+')[0]}", **pins}
    needed = third_party(executor_imports(checkout)) if checkout is not None else set()
    for path in vendored:
        needed |= third_party(_imports(path)[0])
    lines = list(pins.values())
    for when, line in COMPATIBLE:
        if when(pins) and canonical(_NAME.match(line).group(1)) not in pins:
            lines.append(line)
    for module in sorted(needed):
        package = DISTRIBUTION.get(module, module)
        if canonical(package) not in pins:
            pins[canonical(package)] = package     # unpinned: a minority's pin can contradict the stack's
            lines.append(pins[canonical(package)])
    return lines
