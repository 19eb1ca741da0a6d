"""Where a vendored file comes from, as its header and the README name it (checklist 二.9).

`Provenance` is the exact source of one vendored module: a transformers release and the file's path
in that release's repository (`https://github.com/huggingface/transformers/blob/v5.0.0/src/...`), or a
model repository on the hub and its revision (`https://huggingface.co/Org/Name/blob/REV/file.py`), or,
for a local copy whose origin is not known, the file name and that it is not known. Its copyright
lines are the source's own (the file's header, else the modular file it was generated from or the
model folder's configuration file, else transformers' LICENSE holder); its licence is Apache-2.0 for transformers' code, and what the
repository's file says (or "see the model repository") for remote code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRANSFORMERS_REPO = "https://github.com/huggingface/transformers"
APACHE_NOTICE = (
    'Licensed under the Apache License, Version 2.0 (the "License");',
    "you may not use this file except in compliance with the License.",
    "You may obtain a copy of the License at",
    "",
    "    http://www.apache.org/licenses/LICENSE-2.0",
    "",
    "Unless required by applicable law or agreed to in writing, software",
    'distributed under the License is distributed on an "AS IS" BASIS,',
    "WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.",
    "See the License for the specific language governing permissions and",
    "limitations under the License.",
)
# transformers' LICENSE names its holder so; used only where neither the file nor its modular source has a line
TRANSFORMERS_HOLDER = "Copyright 2018- The Hugging Face team. All rights reserved."
_COPYRIGHT_RE = re.compile(r"^#\s*(Copyright\b.*\S)\s*$", re.M | re.I)
_MODULAR_RE = re.compile(r"automatically generated from (src/transformers/models/\S+?\.py)")
REMOTE_PACKAGE = "hf_remote_code"


@dataclass(frozen=True)
class Provenance:
    adapted_from: str               # the exact source: a URL with the release or revision, or what is known
    copyrights: tuple[str, ...]     # "Copyright ..." lines, the source's own
    apache: bool                    # the Apache-2.0 notice applies (transformers' code, or the file says so)
    licence_note: str | None = None  # for remote code without a notice: where its licence is


def transformers_path(module: str) -> str:
    """`transformers.models.gemma2.modeling_gemma2` -> `src/transformers/models/gemma2/modeling_gemma2.py`."""
    return "src/" + module.replace(".", "/") + ".py"


def transformers_ref(version: str) -> str:
    """The git ref of a release: its tag (`v5.0.0`); `main` for a development build."""
    return "main" if not re.fullmatch(r"\d+\.\d+\.\d+(rc\d+)?", version or "") else f"v{version}"


def source_file(module: str) -> str:
    """The file as its repository names it: transformers' path, or the remote repository's file name."""
    if module.startswith(REMOTE_PACKAGE + "."):
        return module.partition(".")[2] + ".py"
    return transformers_path(module)


def copyright_lines(text: str) -> tuple[str, ...]:
    """The "Copyright ..." comment lines of a file's leading comment block (in order, once each)."""
    head = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        head.append(line)
    return tuple(dict.fromkeys(m.group(1) for m in _COPYRIGHT_RE.finditer("\n".join(head))))


def has_apache_notice(text: str) -> bool:
    return "Apache License, Version 2.0" in text[:4000]


def hub_repo_and_revision(model_source: str | None, model_dir: Path | None) -> tuple[str | None, str | None]:
    """(Org/Name, revision) of a hub checkpoint: the source link's repo and /tree/REV, the cache
    snapshot folder's commit (…/snapshots/<sha>/)."""
    repo = rev = None
    source = str(model_source or "")
    m = re.match(r"https://(?:huggingface\.co|hf\.co|(?:www\.)?modelscope\.(?:cn|ai)/models)/([^/\s]+/[^/\s]+)(?:/tree/([^/\s]+))?",
                 source)
    if m:
        repo, rev = m.group(1), m.group(2)
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not (model_dir and Path(source).exists()):
        repo = source
    if rev is None and model_dir is not None and Path(model_dir).parent.name == "snapshots":
        rev = Path(model_dir).name
    return repo, rev


def of_module(module: str, file: Path, version: str | None, model_source: str | None = None,
              model_dir: Path | None = None) -> Provenance:
    """The provenance of one vendored module read from `file` (transformers `version`'s, or the model
    repository's own code for `hf_remote_code.*`)."""
    text = file.read_text(encoding="utf-8", errors="replace")
    own = copyright_lines(text)
    if module.startswith(REMOTE_PACKAGE + "."):
        name = source_file(module)
        repo, rev = hub_repo_and_revision(model_source, model_dir)
        host = "https://modelscope.cn/models" if "modelscope" in str(model_source or "") else "https://huggingface.co"
        if repo and rev:
            where = f"{host}/{repo}/blob/{rev}/{name}"
        elif repo:
            where = f"{host}/{repo} ({name}; revision not recorded)"
        else:
            where = f"{name} of the model repository (a local copy; its hub repository and revision are not recorded)"
        apache = has_apache_notice(text)
        return Provenance(where, own, apache, None if apache else "Licence: see the model repository's licence.")
    copyrights = own
    # a file generated from a modular_*.py without a header: the modular file's lines, else the model
    # folder's configuration file's (the same authors: mistral's modeling and modular files have none)
    modular = _MODULAR_RE.search(text)
    siblings = [file.parent / Path(modular.group(1)).name] if modular else []
    siblings += sorted(file.parent.glob("configuration_*.py"))
    for sibling in siblings:
        if copyrights:
            break
        if sibling.is_file() and sibling != file:
            copyrights = copyright_lines(sibling.read_text(encoding="utf-8", errors="replace"))
    ref = transformers_ref(version or "")
    where = f"{TRANSFORMERS_REPO}/blob/{ref}/{transformers_path(module)}"
    if ref == "main":
        where += f" (transformers {version}, a development build)"
    return Provenance(where, copyrights or (TRANSFORMERS_HOLDER,), True)


def header_lines(prov: Provenance, what: str | None = None) -> list[str]:
    """The header's comment lines (without "# "): upstream's models' layout (models/gpt_oss,
    models/qwen): coding line, what the file is, "Adapted from" and the source, copyright lines,
    the licence notice."""
    lines = ["coding=utf-8"]
    if what:
        lines.append(what)
    lines += ["Adapted from", prov.adapted_from, *prov.copyrights]
    if prov.apache:
        lines += ["", *APACHE_NOTICE]
    elif prov.licence_note:
        lines.append(prov.licence_note)
    return lines


def header_text(prov: Provenance, what: str | None = None) -> str:
    return "".join(f"# {line}\n" if line else "#\n" for line in header_lines(prov, what))


def of_vendored_model(module: str, version: str | None, model_source: str | None, model_dir: str | Path | None) -> Provenance:
    """The provenance of a recipe's vendored modeling module, found again from its name: the model
    repository's file for remote code, the installed transformers' file otherwise (for its copyright
    lines; the URL names `version`'s)."""
    import importlib.util

    model_dir = Path(model_dir) if model_dir else None
    if module.startswith(REMOTE_PACKAGE + "."):
        file = model_dir / source_file(module) if model_dir else None
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        file = Path(spec.origin) if spec is not None and spec.origin else None
    if file is None or not file.is_file():
        ref = transformers_ref(version or "")
        return Provenance(f"{TRANSFORMERS_REPO}/blob/{ref}/{transformers_path(module)}", (TRANSFORMERS_HOLDER,), True)
    return of_module(module, file, version, model_source, model_dir)
