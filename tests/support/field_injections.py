"""Fault injection for every mode of the field corpus (tests/field_faults/corpus.yaml).

Each corpus entry gets one injection: the fault put into a copy of a working recipe, then
`migrator run RECIPE --json` with a relative path from the recipe's parent (our layout) or from the
repository root (the cann-recipes-infer layout of tests/support/checkout_fixture.py), then `migrator rollback
RECIPE` (relative too). Two kinds, and every test id starts with its kind:

- **real**: the fault itself (code calling torch.cuda / torch.npu, a CRLF infer.sh, a YAML syntax
  error, a git-lfs pointer as a weight shard, ...) is written into the recipe or its checkpoint, and
  what fails is torch / transformers / bash on this host, with their own messages.
- **replayed**: faults this CPU host cannot have (an NPU, CANN, HCCL, device ids, out of memory on
  an accelerator, APIs of other releases): recipe code written at the point where the report's
  failure happened (import, model init, generation) writes the report's log lines (the corpus
  `log`, copied from the report) to stderr and exits 1, as the report's process did. What is
  tested is everything after the failure: the run record, diagnosis, repair or report, rollback.

`run_injection` returns what happened; tests/unit/agent/repair/test_field_corpus.py asserts it against the corpus and
scripts/repair_coverage.py --inject tabulates it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from migrator_cli import run_cli
from npu_wheel import torch_npu_wheel
from locations import REPO_ROOT

CORPUS = {e["id"]: e for e in yaml.safe_load((REPO_ROOT / "tests" / "field_faults" / "corpus.yaml").read_text())}

# The migrator's own records, rewritten by every run (not recipe code: compared apart).
RECORDS = {"migration_report.json", "migration_summary.md"}


# ---- where a fault goes -----------------------------------------------------------------
@dataclass
class Target:
    """A private copy of a working recipe to inject into: ours (runner_fi.py on the shared engine)
    or upstream's (models/legacy_llama of a cann-recipes-infer stand-in)."""
    layout: str            # "ours" | "upstream"
    dir: Path              # the recipe
    cwd: Path              # where `migrator run` is started
    rel: str               # the recipe path as the user types it, relative to cwd
    work: Path             # scratch outside the recipe (checkpoint copies)
    env: dict = field(default_factory=dict)   # the run's environment changes (None: unset)

    @property
    def runner(self) -> Path:
        return next(self.dir.glob("runner_*.py"))

    @property
    def yaml(self) -> Path:
        return next((self.dir / "config").glob("*.yaml"))

    @property
    def infer_sh(self) -> Path:
        return self.dir / "infer.sh"

    @property
    def modeling(self) -> Path:
        """Vendored modeling code (ours); upstream's legacy recipe runs transformers' own: its runner."""
        vendored = sorted((self.dir / "models").glob("modeling_*.py")) if (self.dir / "models").is_dir() else []
        return vendored[0] if vendored else self.runner

    # -- code --
    def ensure_torch(self) -> None:
        """torch in the runner's namespace (ours imports it through the engine's guard)."""
        text = self.runner.read_text()
        if re.search(r"^import torch$", text, re.M) or "ModelRunner, torch\n" in text:
            return
        self.runner.write_text(text.replace("from engine.model_runner import ModelRunner\n",
                                            "from engine.model_runner import ModelRunner, torch\n", 1))

    def module_code(self, code: str) -> None:
        """Module-level runner code, after the imports (runs when infer.py imports the runner)."""
        self.ensure_torch()
        text = self.runner.read_text()
        at = re.search(r"^class \w+Runner\(", text, re.M).start()
        self.runner.write_text(text[:at] + code + "\n\n" + text[at:])

    def in_init(self, code: str, after: bool = False) -> None:
        """Code at model init: before (or after) the engine loads config, weights and tokenizer."""
        self.ensure_torch()
        header = "    def init_model(self, *args, **kwargs):\n"
        call = "        super().init_model(*args, **kwargs)\n"
        text = self.runner.read_text().rstrip("\n") + "\n"
        if header not in text:
            text += "\n" + header + call
        anchor = text.index(header) + len(header) + (len(call) if after else 0)
        self.runner.write_text(text[:anchor] + code + text[anchor:])

    def in_generate(self, code: str) -> None:
        """Code as each generation starts (warm-up first)."""
        self.ensure_torch()
        header = "    def model_generate(self, prompts, warm_up=False):\n"
        text = self.runner.read_text()
        if header not in text:
            self.runner.write_text(text.rstrip("\n") + "\n\n" + header +
                                   "        return super().model_generate(prompts, warm_up)\n")
        text = self.runner.read_text()
        anchor = text.index(header) + len(header)
        self.runner.write_text(text[:anchor] + code + text[anchor:])

    # -- files --
    def edit(self, path: Path, old: str, new: str, count: int = 1) -> None:
        text = path.read_text()
        assert old in text, f"{path.name}: {old!r} not found"
        path.write_text(text.replace(old, new, count))

    def yaml_after(self, key_line: str, text: str) -> None:
        """Insert lines after the first YAML line starting with key_line."""
        lines = self.yaml.read_text().splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if ln.startswith(key_line))
        lines.insert(at + 1, text)
        self.yaml.write_text("".join(lines))

    def model_path(self) -> Path:
        value = re.search(r'^model_path:\s*"?([^"\n]+?)"?\s*$', self.yaml.read_text(), re.M).group(1)
        path = Path(value)
        return path if path.is_absolute() else (self.dir / path).resolve()

    def own_checkpoint(self) -> Path:
        """A copy of the checkpoint outside the recipe that the YAML now points at (to damage it)."""
        source = self.model_path()
        copy = self.work / "checkpoint"
        shutil.copytree(source, copy)
        text = self.yaml.read_text()
        self.yaml.write_text(re.sub(r'^(model_path:\s*"?)[^"\n]+?("?\s*)$', lambda m: f"{m[1]}{copy}{m[2]}",
                                    text, count=1, flags=re.M))
        return copy


def replay(entry_id: str, indent: str = "        ") -> str:
    """Code that writes the report's log (corpus `log`) to stderr and exits 1, as the report's process
    ended (with an error, after printing those lines)."""
    entry = CORPUS[entry_id]
    pad = indent
    return (f"{pad}# REPLAYED ({entry['source']}): this host cannot have this failure; the report's\n"
            f"{pad}# lines are written where it happened and the process exits as it did.\n"
            f"{pad}import sys as _replay_sys\n"
            f"{pad}_replay_sys.stderr.write({entry['log']!r})\n"
            f"{pad}_replay_sys.stderr.flush()\n"
            f"{pad}raise SystemExit(1)\n")


# ---- the injections, one per corpus entry -----------------------------------------------
# Real ones first by category; each docstring says what the report had and what is written here.

def with_torch_npu(t: Target) -> None:
    """The real torch-npu wheel (torch's release) on the run's PYTHONPATH, and no CANN: the host of
    the reports, where `import torch_npu` fails on libhccl.so for real."""
    wheel, why = torch_npu_wheel()
    assert wheel is not None, why
    t.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(wheel), os.environ.get("PYTHONPATH")]))
    for name in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        t.env[name] = None


def npu_import_libhccl_on_cpu_host(t: Target) -> None:
    """X-Oscar#4: recipe code imports torch_npu (only incidentally) on a host with torch_npu and no
    CANN. Upstream's executor imports torch plainly, which would fail first (torch's backend
    autoload: the next mode), so its host sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 as that mode advises."""
    with_torch_npu(t)
    t.module_code("import torch_npu\n")
    if t.layout == "upstream":
        t.env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"


def torch_npu_autoload_fails_import_torch(t: Target) -> None:
    """flash-linear-attention-npu#2: torch >= 2.5 autoloads the installed torch_npu at `import torch`,
    which fails without CANN. Upstream's executor imports torch plainly; ours imports it through the
    engine's guard, so the fault is the user's own `import torch` put first in infer.py."""
    with_torch_npu(t)
    if t.layout == "ours":
        infer = t.dir / "infer.py"
        text = infer.read_text()
        at = re.search(r"^(from|import) ", text, re.M).start()
        infer.write_text(text[:at] + "import torch\n" + text[at:])


def npu_module_missing_with_npu_calls(t: Target) -> None:
    """vllm-ascend#166: torch_npu is not installed and the recipe imports it and calls torch.npu."""
    t.module_code("import torch_npu\n")
    t.in_generate("        torch.npu.synchronize()\n        peak = torch.npu.max_memory_allocated()\n")


def torch_npu_from_source_tree(t: Target) -> None:
    """Ascend/pytorch#24: run from a directory holding torch_npu's source tree, whose package imports
    its compiled extension torch_npu._C that was never built there."""
    pkg = t.dir / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("# torch_npu source checkout (not built): the package imports its C extension\n"
                                     "import torch_npu._C\n")
    t.module_code("import torch_npu\n")


def nccl_shared_library_missing(t: Target) -> None:
    """MinerU#419: recipe code loads a native library (libnccl.so.2) the host does not have."""
    t.module_code("import ctypes\n\nctypes.CDLL(\"libnccl.so.2\")\n")


def npu_kernel_geglu_missing(t: Target) -> None:
    """Ascend/pytorch#23: the recipe calls an NPU kernel (torch_npu.npu_geglu)."""
    t.module_code("import torch_npu\n")
    t.in_generate("        torch_npu.npu_geglu(torch.ones(2, 4))\n")


def npu_kernel_rotary_missing(t: Target) -> None:
    """vllm-ascend#218: the recipe calls a private NPU kernel (torch_npu._npu_rotary_embedding)."""
    t.module_code("import torch_npu\n")
    t.in_generate("        torch_npu._npu_rotary_embedding(torch.ones(1, 4), torch.ones(1, 4), torch.ones(1, 4))\n")


def cuda_synchronize_on_cpu(t: Target) -> None:
    """PyTorch-Simple-MaskRCNN#6: torch.cuda.synchronize() in timing code on a CPU-only torch."""
    t.in_generate("        torch.cuda.synchronize()\n")


def cuda_set_device_on_cpu(t: Target) -> None:
    """pytorch#28111: torch.cuda.set_device in a recipe run on a CPU-only torch."""
    t.in_generate("        torch.cuda.set_device(0)\n")


def cuda_only_code_on_cpu(t: Target) -> None:
    """xtts2-ui#28: .cuda() in recipe code on a host without CUDA."""
    t.in_generate("        scale = torch.ones(1).cuda()\n")


def torchrun_port_in_use(t: Target) -> None:
    """llama-models#210: the rendezvous port is held by another run (here: a socket this process
    holds) when the process group starts on it."""
    t.in_init("        import socket\n"
              "        held = socket.socket()\n"
              "        held.bind((\"127.0.0.1\", 0))\n"
              "        held.listen()\n"
              "        port = held.getsockname()[1]\n"
              "        torch.distributed.init_process_group(\"gloo\", init_method=f\"tcp://127.0.0.1:{port}\",\n"
              "                                             rank=0, world_size=1)\n")


def process_group_not_initialized(t: Target) -> None:
    """InstructSeg#7: a torch.distributed collective in a single-process run."""
    t.in_generate("        torch.distributed.barrier()\n")


def infer_sh_crlf(t: Target) -> None:
    """DiffRhythm#115: infer.sh saved with Windows line endings."""
    t.infer_sh.write_bytes(t.infer_sh.read_bytes().replace(b"\n", b"\r\n"))


def install_sh_crlf_unexpected_token(t: Target) -> None:
    """whisper.cpp#2377: a CRLF shell script fails at its first function definition."""
    text = t.infer_sh.read_text()
    lines = text.splitlines(keepends=True)
    at = max(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#")) if t.layout == "upstream" \
        else next(i for i, ln in enumerate(lines) if "exec " in ln)
    lines[at:at] = ["log_start() {\n", "    echo \"starting $(basename \"$0\")\"\n", "}\n", "log_start\n"]
    t.infer_sh.write_bytes("".join(lines).replace("\n", "\r\n").encode())


def script_not_executable(t: Target) -> None:
    """lora-scripts#251: infer.sh runs a helper as ./script.sh, and the helper is not executable."""
    helper = t.dir / "prepare.sh"
    helper.write_text("#!/usr/bin/env bash\necho prepared\n")
    helper.chmod(0o644)
    t.edit(t.infer_sh, 'cd "$SCRIPT_DIR"\n', 'cd "$SCRIPT_DIR"\n./prepare.sh\n')


def yaml_mapping_values(t: Target) -> None:
    """Swar-Chia-Plot-Manager#250: an unquoted value containing ': '."""
    t.yaml_after("world_size:", "exe_mode: eager: fast\n")


def yaml_mapping_values_nested(t: Target) -> None:
    """DEIM#36: a mapping nested under a scalar value."""
    t.yaml_after("world_size:", "  extra: 1\n")


def mixed_dtype_bf16_float(t: Target) -> None:
    """LETTER#1: recipe code makes a float32 tensor that meets bfloat16 weights (bmm: the report's message)."""
    if t.layout == "ours":
        t.edit(t.yaml, "  dtype: float32\n", "  dtype: bfloat16\n")
        t.in_generate("        if self.model is not None:\n"
                      "            weight = self.model.get_input_embeddings().weight[:4]\n"
                      "            probe = torch.ones(1, 1, weight.shape[1])\n"
                      "            torch.bmm(probe, weight.T[None])\n")
    else:   # upstream's executor loads float32 and has no dtype key: a bfloat16 tensor made by recipe code
        t.in_generate("        weight = self.model.get_input_embeddings().weight[:4]\n"
                      "        torch.bmm(weight[None], torch.ones(1, weight.shape[1], 1, dtype=torch.bfloat16))\n")


def mixed_dtype_bf16_float_reverse(t: Target) -> None:
    """robometer#38: bfloat16 weights first, a float32 input second (inputs not cast)."""
    t.edit(t.yaml, "  dtype: float32\n", "  dtype: bfloat16\n")
    t.in_generate("        if self.model is not None:\n"
                  "            weight = self.model.get_input_embeddings().weight[:4]\n"
                  "            torch.bmm(weight[None], torch.ones(1, weight.shape[1], 1))\n")


def nan_probabilities(t: Target) -> None:
    """baby-llama2-chinese#33: sampling on nan probabilities."""
    t.in_generate("        torch.multinomial(torch.full((1, 4), float(\"nan\")), 1)\n")


def nan_probabilities_multicard(t: Target) -> None:
    """InternLM#459: sampling on probabilities with an inf (overflowed logits)."""
    t.in_generate("        torch.multinomial(torch.tensor([[float(\"inf\"), 1.0]]), num_samples=1)\n")


def safetensors_header_too_large(t: Target) -> None:
    """ProcessPainter#5: the weight shard is a git-lfs pointer file (weights never pulled)."""
    ckpt = t.own_checkpoint()
    (ckpt / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1234567\n")


def safetensors_header_too_large_lowercase(t: Target) -> None:
    """safetensors#668: a shard whose header length is over the reader's limit."""
    ckpt = t.own_checkpoint()
    shard = ckpt / "model.safetensors"
    shard.write_bytes((200 * 1024 * 1024).to_bytes(8, "little") + shard.read_bytes()[8:])


def size_mismatch_loading(t: Target) -> None:
    """deep-code-search#77: the config's vocabulary does not match the checkpoint's embedding rows."""
    ckpt = t.own_checkpoint()
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] += 16
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))


def meta_tensor_copy(t: Target) -> None:
    """Search-Your-PDF-App#7: a tensor left on the meta device (never loaded) is moved to the device."""
    t.in_init("        scale = torch.empty(4, device=\"meta\")\n        scale = scale.to(\"cpu\")\n")


def model_type_unknown(t: Target) -> None:
    """ComfyUI_ExtraModels#114: the checkpoint's model_type is newer than the installed transformers
    (ours loads its vendored config class, so the recipe code reads the config with AutoConfig, as
    the report's code did; upstream's executor loads AutoModelForCausalLM itself)."""
    ckpt = t.own_checkpoint()
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "gemma9"
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    if t.layout == "ours":
        t.in_init("        from transformers import AutoConfig\n"
                  "        AutoConfig.from_pretrained(self.model_path, local_files_only=True)\n")


def sentencepiece_missing(t: Target) -> None:
    """MELoRA#4: a checkpoint with a SentencePiece tokenizer (tokenizer.model, LlamaTokenizer, no
    tokenizer.json) on a host without sentencepiece."""
    ckpt = t.own_checkpoint()
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "LlamaTokenizer"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def pad_token_missing(t: Target) -> None:
    """BELLE#103: the recipe loads its own tokenizer (no pad token in the checkpoint) and pads a batch."""
    ckpt = t.own_checkpoint()
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    t.in_init("        from transformers import AutoTokenizer\n"
              "        tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)\n"
              "        tokenizer.padding_side = \"left\"\n"
              "        self.tokenizer = tokenizer\n", after=True)
    if t.layout == "upstream":     # upstream's runner tokenizes without padding: a batched recipe pads
        t.edit(t.runner, "return_tensors=\"pt\", truncation=True", "return_tensors=\"pt\", padding=True, truncation=True")


def flash_attn_not_installed(t: Target) -> None:
    """EasyR1#384: modeling code imports flash_attn, which is not installed (the corpus's recipe code;
    the YAML toggle attn_implementation: flash_attention_2 is refused by engine.config first)."""
    path = t.modeling
    text = path.read_text()
    at = re.search(r"^(from|import) ", text, re.M).start()
    path.write_text(text[:at] + "from flash_attn import flash_attn_func\n" + text[at:])


def transformers_import_moved(t: Target) -> None:
    """transformers#36503: modeling code imports a name transformers no longer has there."""
    path = t.modeling
    text = path.read_text()
    at = re.search(r"^(from|import) ", text, re.M).start()
    path.write_text(text[:at] + "from transformers.utils import add_model_info_to_custom_pipelines\n" + text[at:])


def transformers_module_moved(t: Target) -> None:
    """Graph-Bert#16: modeling code imports an old module path (transformers.modeling_bert)."""
    path = t.modeling
    text = path.read_text()
    at = re.search(r"^(from|import) ", text, re.M).start()
    path.write_text(text[:at] + "from transformers.modeling_bert import BertPreTrainedModel\n" + text[at:])


def rope_scaling_type_key(t: Target) -> None:
    """KBLaM#37: code written before transformers renamed rope_scaling["type"] to "rope_type"."""
    if t.layout == "ours":
        t.edit(t.modeling, 'self.config.rope_parameters["rope_type"]', 'self.config.rope_scaling["type"]')
    else:
        t.in_init("        rope_kind = self.model.config.rope_scaling[\"type\"]\n", after=True)


def rope_scaling_two_fields(t: Target) -> None:
    """ChatterBox_Voice#1: configuration code with the old two-field rope_scaling check (as
    transformers < 4.43 had it) and a checkpoint with a llama3 rope_scaling."""
    ckpt = t.own_checkpoint()
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_scaling"] = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    config.pop("rope_parameters", None)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    t.in_init("        from transformers import AutoConfig\n"
              "        rope_scaling = json.load(open(os.path.join(self.model_path, \"config.json\")))[\"rope_scaling\"]\n"
              "        # transformers < 4.43 LlamaConfig._rope_scaling_validation\n"
              "        if not isinstance(rope_scaling, dict) or len(rope_scaling) != 2:\n"
              "            raise ValueError(\n"
              "                \"`rope_scaling` must be a dictionary with with two fields, `type` and `factor`, \"\n"
              "                f\"got {rope_scaling}\"\n"
              "            )\n")
    t.module_code("import json\nimport os\n")


def rope_scaling_missing_original_max(t: Target) -> None:
    """aiter#4742: code that expects yarn keys in rope_scaling reads original_max_position_embeddings."""
    if t.layout == "ours":
        t.edit(t.modeling, 'self.config.rope_parameters["rope_type"]',
               'self.config.rope_scaling["original_max_position_embeddings"]')
    else:
        t.in_init("        original_max_position = self.model.config.rope_scaling[\"original_max_position_embeddings\"]\n",
                  after=True)


def torch_has_no_npu_on_cpu(t: Target) -> None:
    """Local: torch.npu bookkeeping on a host without torch_npu."""
    t.in_generate("        devices = torch.npu.device_count()\n")


def npu_device_string_on_cpu(t: Target) -> None:
    """Local: torch.device("npu", i) on a host without torch_npu."""
    t.in_generate("        npu = torch.device(\"npu\", 0)\n")


def fp16_on_cpu_addmm(t: Target) -> None:
    """transformers#27769: float16 weights on a CPU without half kernels. This torch has them, so the
    report's error is replayed when the weights really are float16 (after the fix they are not)."""
    t.edit(t.yaml, "  dtype: float32\n", "  dtype: float16\n")
    t.in_generate("        if self.model is not None and self.model.dtype == torch.float16:\n"
                  + replay("fp16-on-cpu-addmm", indent="            "))


@dataclass
class Injection:
    id: str                               # the corpus entry
    kind: str                             # real | replayed
    inject: Callable[[Target], None] | None
    note: str | None = None               # reported: text the rule's note must carry ({runner}: the runner file)
    fast: bool = False                    # ours in `make test` (one per rule at most)
    fast_upstream: bool = False           # upstream in `make test`
    upstream: bool = False                # also injected into the upstream-style recipe
    upstream_expected: str | None = None  # where upstream's layout ends otherwise (see `why`)
    upstream_rules: list | None = None    # the rule of each round there
    upstream_note: str | None = None
    needs_torch_npu: bool = False         # real only with the torch-npu wheel (skipped without it)
    where: str = ""                       # replayed: import | init | generate
    why: str = ""                         # why upstream ends otherwise
    replayed_why: str = ""                # why a mode this host could have is replayed

    @property
    def entry(self) -> dict:
        return CORPUS[self.id]

    def expected(self, layout: str) -> str:
        """repaired | reported | oom | exit4 | unknown"""
        if layout == "upstream" and self.upstream_expected:
            return self.upstream_expected
        return "oom" if self.entry.get("oom") else self.entry["outcome"]

    def rules(self, layout: str) -> list:
        """The diagnosed rule of each repair round."""
        if layout == "upstream" and self.upstream_rules:
            return self.upstream_rules
        return {"oom": ["out_of_memory"], "exit4": [], "unknown": [None]}.get(
            self.expected(layout), [self.entry["expected_rule"]])

    def rule(self, layout: str) -> str | None:
        """The rule that takes the failure first (None: none)."""
        rules = self.rules(layout)
        return rules[0] if rules else None

    def expected_note(self, layout: str) -> str | None:
        return self.upstream_note if layout == "upstream" and self.upstream_note else self.note

    def test_id(self, layout: str) -> str:
        return f"{self.kind}-{layout}-{self.id}"

    def apply(self, t: Target) -> None:
        if self.inject is not None:
            self.inject(t)
        elif self.where == "import":
            t.module_code(replay(self.id, indent=""))
        elif self.where == "init":
            t.in_init(replay(self.id))
        else:
            t.in_generate(replay(self.id))


def _real(id, fn, **kw) -> Injection:
    return Injection(id, "real", fn, **kw)


def _replayed(id, where, **kw) -> Injection:
    return Injection(id, "replayed", None, where=where, **kw)


INJECTIONS: list[Injection] = [
    # imports / environment
    _real("npu-import-libhccl-on-cpu-host", npu_import_libhccl_on_cpu_host, upstream=True, needs_torch_npu=True,
          upstream_expected="reported", upstream_rules=["incidental_npu_call", "torch_npu_without_cann"],
          upstream_note="libhccl.so is missing",
          why="upstream runs transformers without the engine's torch_npu guard: once the recipe's own import is "
              "guarded (round 1), transformers' is_torch_npu_available() imports torch_npu and fails the same "
              "way, which round 2 reports as CANN missing"),
    _real("npu-module-missing-with-npu-calls", npu_module_missing_with_npu_calls, upstream=True, fast_upstream=True),
    _real("torch-npu-from-source-tree", torch_npu_from_source_tree,
          note="`import torch_npu` picked up the torch_npu source directory instead of the installed package"),
    _real("torch-npu-autoload-fails-import-torch", torch_npu_autoload_fails_import_torch, upstream=True,
          needs_torch_npu=True, note="torch >= 2.5 auto-loads torch_npu at `import torch` and that failed"),
    _replayed("atb-library-missing", "import", note="libatb.so is missing ("),
    _replayed("cann-deps-init-env-failed", "init", note="the CANN runtime could not start"),
    _replayed("libgomp-static-tls", "import",
              note="/root/workspaces/mamba/envs/cann/bin/../lib/libgomp.so.1 cannot be loaded late: export "
                   "LD_PRELOAD=/root/workspaces/mamba/envs/cann/bin/../lib/libgomp.so.1 before infer.sh"),
    _real("nccl-shared-library-missing", nccl_shared_library_missing, note="libnccl.so.2 is not found ({runner}:"),
    # device calls
    _real("npu-kernel-geglu-missing", npu_kernel_geglu_missing, fast=False, upstream=True),
    _real("npu-kernel-rotary-missing", npu_kernel_rotary_missing),
    _replayed("torch-npu-profile-api-moved", "generate", note="torch_npu has no profile"),
    _replayed("integer-device-means-cuda", "init", fast=False,
              replayed_why="torch 2.13 says 'Cannot access accelerator device when none is available.' for .to(0) "
                           "on a CPU-only build, not the report's CUDA assertion"),
    _real("cuda-synchronize-on-cpu", cuda_synchronize_on_cpu, upstream=True),
    _real("cuda-set-device-on-cpu", cuda_set_device_on_cpu, upstream=True),
    _real("cuda-only-code-on-cpu", cuda_only_code_on_cpu, upstream=True),
    _replayed("npu-visible-devices-mismatch", "init",
              note="open device 0 failed, runtime result = 107001: ranks are numbered from 0 within "
                   "ASCEND_RT_VISIBLE_DEVICES"),
    _replayed("npu-set-device-507033", "init", note="SetDevice(device_id_), error code is 507033: ranks are numbered"),
    _replayed("npu-noncontiguous-device-ids", "init", note="Invalid device id: ranks are numbered from 0"),
    _replayed("npu-device-held-by-other-process", "init",
              note="because the device is used. ret is -8020: another process holds the NPU"),
    _replayed("hccp-last-process-running", "init",
              note="Maybe the last training process is running: another process holds the NPU"),
    _replayed("hccl-comm-init-root-info", "init", fast=False,
              note="HcclCommInitRootInfo(numRanks, &rootInfo, rank, &(comm->hcclComm_)): the ranks could not form "
                   "an HCCL group"),
    _replayed("hccl-allreduce-socket-timeout", "generate", note="a rank is stuck or dead"),
    _real("torchrun-port-in-use", torchrun_port_in_use, fast=False,
          note="EADDRINUSE, message: address already in use: another job holds the master port: stop it or export "
               "MASTER_PORT=<free port> before infer.sh"),
    _replayed("torchrun-port-in-use-errno98", "init",
              note="errno: 98 - Address already in use). The server socket has failed to bind to ?UNKNOWN? "
                   "(errno: 98 - Address already in use).: another job holds the master port"),
    _real("process-group-not-initialized", process_group_not_initialized, upstream=True,
          note="{runner}:", upstream_note="{runner}:"),
    # memory: the out-of-memory path of diagnose
    _replayed("npu-oom", "generate", fast=True, upstream=True),
    _replayed("npu-oom-watchdog-noise", "generate"),
    _replayed("npu-oom-corrupt-size", "generate"),
    _replayed("cuda-oom", "generate"),
    # shell / YAML
    _real("infer-sh-crlf", infer_sh_crlf, fast=True, upstream=True),
    _real("install-sh-crlf-unexpected-token", install_sh_crlf_unexpected_token, upstream=True),
    _real("script-not-executable", script_not_executable, fast=True,
          note="./prepare.sh is not executable: run it as `bash ./prepare.sh` (what migrator does) or chmod +x it"),
    _real("yaml-mapping-values", yaml_mapping_values, fast=True, upstream=True,
          note="config/fi_1card_eager.yaml line 8 column 16 is not valid YAML (ScannerError): mapping values are "
               "not allowed here: 'exe_mode: eager: fast'",
          upstream_note="config/legacy_llama.yaml line 5 column 16 is not valid YAML (ScannerError): mapping "
                        "values are not allowed here: 'exe_mode: eager: fast'"),
    _real("yaml-mapping-values-nested", yaml_mapping_values_nested,
          note="config/fi_1card_eager.yaml line 8 column 8 is not valid YAML (ScannerError): mapping values are "
               "not allowed here: '  extra: 1'"),
    # dtype / output quality
    Injection("fp16-on-cpu-addmm", "replayed", fp16_on_cpu_addmm,
              replayed_why="torch 2.13 has float16 CPU kernels; the replay runs only while the weights are float16"),
    _real("mixed-dtype-bf16-float", mixed_dtype_bf16_float, upstream=True, upstream_expected="reported",
          upstream_note="tensors of Float and BFloat16 meet at {runner}:",
          why="upstream's executor loads float32 whatever the YAML says (no model_config.dtype): the rule "
              "reports where the dtypes meet instead of editing the YAML"),
    _real("mixed-dtype-bf16-float-reverse", mixed_dtype_bf16_float_reverse),
    _real("nan-probabilities", nan_probabilities, upstream=True, note="{runner}:"),
    _real("nan-probabilities-multicard", nan_probabilities_multicard, note="{runner}:"),
    # weights and tokenizer
    _real("safetensors-header-too-large", safetensors_header_too_large,
          note="model.safetensors are git-lfs pointer files, not weights: run `git lfs pull` in"),
    _real("safetensors-header-too-large-lowercase", safetensors_header_too_large_lowercase,
          note="is truncated or not a safetensors file: re-download it"),
    _real("size-mismatch-loading", size_mismatch_loading,
          note="checkpoint torch.Size([384, 64]) vs model torch.Size([400, 64]): config.json (vocab_size / hidden "
               "sizes) does not describe these weights"),
    _real("meta-tensor-copy", meta_tensor_copy, note="{runner}:"),
    _real("model-type-unknown", model_type_unknown, upstream=True,
          note="model type gemma9 is unknown to the installed transformers"),
    _replayed("tokenizer-class-typo", "init", note="tokenizer class LlamaTokenizer is unknown: fix tokenizer_class",
              replayed_why="transformers 5 no longer raises it: a misspelt tokenizer_class falls back to tokenizer.json"),
    _real("sentencepiece-missing", sentencepiece_missing,
          note="module sentencepiece is not installed; install it with"),
    _real("pad-token-missing", pad_token_missing, upstream=True),
    _real("flash-attn-toggled-not-installed", flash_attn_not_installed, upstream=True),
    _real("transformers-import-moved", transformers_import_moved,
          note="models/modeling_fi.py:"),
    _real("transformers-module-moved", transformers_module_moved, note="models/modeling_fi.py:"),
    _real("rope-scaling-type-key", rope_scaling_type_key, upstream=True),
    _real("rope-scaling-two-fields", rope_scaling_two_fields, note="rope_scaling key 'type/factor' at {runner}:"),
    _real("rope-scaling-missing-original-max", rope_scaling_missing_original_max,
          note="rope_scaling key 'original_max_position_embeddings' at models/modeling_fi.py:"),
    _real("torch-has-no-npu-on-cpu", torch_has_no_npu_on_cpu, upstream=True),
    _real("npu-device-string-on-cpu", npu_device_string_on_cpu, upstream=True),
]
BY_ID = {i.id: i for i in INJECTIONS}
assert len(BY_ID) == len(INJECTIONS) == len(CORPUS) and set(BY_ID) == set(CORPUS), set(CORPUS) ^ set(BY_ID)


def cases() -> list[tuple[Injection, str]]:
    """(injection, layout) for every run: every corpus entry in ours, the `upstream` ones there too."""
    return [(i, "ours") for i in INJECTIONS] + [(i, "upstream") for i in INJECTIONS if i.upstream]


# ---- the working recipes to copy --------------------------------------------------------
def build_working_recipe(work: Path) -> Path:
    """A tiny llama migrated once into work/working/fi (cached)."""
    out = work / "working"
    if not (out / "fi" / "infer.sh").is_file():
        from agent.testing.tiny_checkpoint import build_tiny_checkpoint
        checkpoint = build_tiny_checkpoint("llama", work / "tiny_llama")
        proc = run_cli("run", str(checkpoint), "--name", "fi", "--output-dir", str(out), "--device", "cpu",
                       "--max-new-tokens", "8")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "fi"


def make_target(layout: str, work: Path, source: Path) -> Target:
    """A fresh copy to inject into: ours copies `source` (a working recipe), upstream writes a
    cann-recipes-infer stand-in (tests/support/checkout_fixture.py) whose recipes use the checkpoint of `source`."""
    work.mkdir(parents=True, exist_ok=True)
    if layout == "ours":
        recipe = work / "fi"
        shutil.copytree(source, recipe, ignore=shutil.ignore_patterns(".migrator", "res", "baseline", "__pycache__"))
        return Target("ours", recipe, work, "fi", work / "scratch")
    from checkout_fixture import write_repo

    checkpoint = Target("ours", source, source.parent, source.name, work).model_path()
    root = work / "cann-recipes-infer"
    recipe = write_repo(root, checkpoint)["legacy_llama"]
    return Target("upstream", recipe, root, "models/legacy_llama", work / "scratch")


def cli(*args: str, cwd: Path, env: dict):
    """`migrator ARGS` as migrator_cli.run_cli runs it, with `env` applied (None: unset)."""
    environ = {k: v for k, v in os.environ.items() if env.get(k, v) is not None}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=environ)


def snapshot(recipe: Path) -> dict[str, tuple[bytes, int]]:
    """Every recipe file (as agent.recipe.backup sees them) with its bytes and mode."""
    from agent.recipe.backup import recipe_files

    return {rel: (path.read_bytes(), stat.S_IMODE(path.stat().st_mode)) for rel, path in recipe_files(recipe).items()}


def run_injection(injection: Injection, layout: str, work: Path, source: Path) -> dict:
    """Inject one fault into a fresh copy, `migrator run REL --json` from the recipe's parent (ours)
    or the repository root (upstream), then `migrator rollback REL`. Returns what happened."""
    t = make_target(layout, work, source)
    t.work.mkdir(parents=True, exist_ok=True)
    injection.apply(t)
    injected = snapshot(t.dir)
    start = time.perf_counter()
    proc = cli("run", t.rel, "--json", cwd=t.cwd, env=t.env)
    seconds = round(time.perf_counter() - start, 1)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    report_file = t.dir / "migration_report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() and \
        report_file.stat().st_mtime >= time.time() - seconds - 5 else {}
    rounds = report.get("rounds", [])
    first, last = (rounds[0], rounds[-1]) if rounds else ({}, {})
    diagnosis = first.get("diagnosis") or {}
    rules = [(r.get("diagnosis") or {}).get("rule") for r in rounds]
    if proc.returncode == 4:
        outcome = "exit4"
    elif proc.returncode == 6 and summary.get("status") == "oom" and (last.get("diagnosis") or {}).get("oom"):
        outcome = "oom"
    elif proc.returncode == 0 and summary.get("status") == "ok" and first.get("applied"):
        outcome = "repaired"
    elif rules and rules[-1] is not None and not last.get("applied"):
        outcome = "reported"
    elif rules and rules[-1] is None:
        outcome = "unknown"
    else:
        outcome = f"other (exit {proc.returncode}, status {summary.get('status')})"
    backup = t.dir / ".migrator" / "backup" / "round_1"
    had_backup = backup.is_dir()
    back = cli("rollback", t.rel, cwd=t.cwd, env=t.env)
    after = snapshot(t.dir)
    own = RECORDS | {"README.md"}     # the migrator's records (and the README's status block): not a repair's
    if had_backup:
        rollback = "restored" if back.returncode == 0 and {k: v for k, v in after.items() if k not in own} == \
            {k: v for k, v in injected.items() if k not in own} else "FAILED"
    else:   # no repair round ran (out of memory, exit 4, unknown): nothing to restore, nothing changed
        same = {k: v for k, v in after.items() if k not in RECORDS} == \
            {k: v for k, v in injected.items() if k not in RECORDS}
        rollback = "untouched" if back.returncode == 2 and "no repair backups" in back.stderr and same else "FAILED"
    ok = (outcome == injection.expected(layout) and rules == injection.rules(layout) and rollback != "FAILED")
    return {"id": injection.id, "kind": injection.kind, "layout": layout, "test_id": injection.test_id(layout),
            "ok": ok,
            "expected": injection.expected(layout), "expected_rules": injection.rules(layout),
            "outcome": outcome, "rule": rules[0] if rules else None, "rules": rules, "rounds": len(rounds),
            "note": last.get("note", ""), "returncode": proc.returncode, "summary": summary, "first": first,
            "last": last, "diagnosis": diagnosis, "round_records": rounds,
            "injected": injected, "recipe": t.dir, "backup": backup, "had_backup": had_backup,
            "rollback": rollback, "rollback_ok": rollback != "FAILED", "seconds": seconds,
            "stderr": proc.stderr[-3000:], "rollback_stderr": back.stderr[-1000:]}
