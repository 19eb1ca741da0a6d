"""A repository laid out like hicann/cann-recipes-infer, small enough to run on CPU.

``write_repo(root, checkpoint)`` writes:

    executor/                         STAND-IN for the repository's shared executor: same entry
      scripts/{infer.sh, function.sh,   points, same launch (per-rank `python infer.py ... | tee
               set_env.sh}              res/<date>/<case>/log_N.log &` then `wait`, so it exits 0
      model_runner.py                   even when Python crashed), same log formats; the model is
      offline/infer.py                  plain transformers/torch on CPU instead of torch_npu.
      core/scheduler.py
      utils/{__init__, logging_config}.py
    models/
      legacy_llama/   legacy ModelRunner recipe with its own infer.sh (sources executor/scripts/function.sh)
      fw_llama/       framework recipe: config/*.yaml only, run by executor/scripts/infer.sh --model --yaml
      npu_legacy/     legacy recipe whose modeling calls torch_npu kernels (NPU-only)
      npu_fw/         framework recipe whose modeling calls torch.ops.npu kernels (NPU-only)

The log formats are copied from upstream: legacy ``%(asctime)s - %(levelname)s - [LLM](%(filename)s:%(lineno)d):
%(message)s`` with ``{name} inference time cost of {prefill|decode} is X ms`` (warm-up calls log too),
framework ``[%(levelname)s][%(asctime)s.%(msecs)03d][%(filename)s:%(lineno)d] %(message)s`` with
``[Main] Inference time ({prefill|decode}): X ms`` (the engine warms up silently) and
``Request N: outputs: TEXT``.
"""

from __future__ import annotations

from pathlib import Path

PROMPT = "Attention lets a model"

# ---- the stand-in executor ------------------------------------------------------------------
SET_ENV_SH = """#!/bin/bash
# STAND-IN of cann-recipes-infer executor/scripts/set_env.sh (no CANN on this host).
export ON_CLOUD=0
recipes_path=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)
export PYTHONPATH=$PYTHONPATH:$recipes_path
"""

FUNCTION_SH = r"""#!/bin/bash
# STAND-IN of cann-recipes-infer executor/scripts/function.sh: same RES_PATH, same per-rank launch
# ending in `wait` (so the script exits 0 even when Python crashed).
PY="${PYTHON:-python3}"

function launch()
{
    mode=${1:-offline}
    WORLD_SIZE=$($PY -c "import yaml; d=yaml.safe_load(open('$YAML')); print((d.get('parallel_config') or {}).get('world_size') or d.get('world_size') or 1)")
    MODEL_NAME=$($PY -c "import yaml; d=yaml.safe_load(open('$YAML')); print((d.get('model_config') or {}).get('model_name') or d['model_name'])")
    export WORLD_SIZE
    echo "world_size is: $WORLD_SIZE"
    DATE=`date +%Y%m%d`
    PREFIX=$(basename "$YAML")
    PREFIX="${PREFIX%.*}"
    export RES_PATH="res/${DATE}/${MODEL_NAME}_${PREFIX}"
    WORK_DIR=`pwd`
    mkdir -p ${WORK_DIR}/${RES_PATH}
    SCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" &>/dev/null && pwd)
    PARENT_PARENT_DIR=$(cd "$SCRIPT_PATH/../.." &>/dev/null && pwd)
    INFER_PATH=${PARENT_PARENT_DIR}/models/${MODEL_DIR}/infer.py
    if [ ! -f "${INFER_PATH}" ]; then
        INFER_PATH="${PARENT_PARENT_DIR}/executor/offline/infer.py"
    fi
    for((i=0; i<${WORLD_SIZE}; i++))
    do
        export LOCAL_RANK=$i
        export RANK_ID=$i
        if [ $i -eq 0 ]; then
            "$PY" "${INFER_PATH}" --yaml_file_path="${YAML}" 2>&1 | tee ${WORK_DIR}/${RES_PATH}/log_${LOCAL_RANK}.log &
        else
            "$PY" "${INFER_PATH}" --yaml_file_path="${YAML}" &> ${WORK_DIR}/${RES_PATH}/log_${LOCAL_RANK}.log &
        fi
    done
    wait
}
"""

ENTRY_INFER_SH = r"""#!/bin/bash
# STAND-IN of cann-recipes-infer executor/scripts/infer.sh (offline mode only).
SCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" &>/dev/null && pwd)
source "${SCRIPT_PATH}/set_env.sh"
source "${SCRIPT_PATH}/function.sh"

MODEL="deepseek_r1"
MODE="offline"
YAML_FILE="decode_r1_rank_16_16ep_a8w8.yaml"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model)   MODEL="$2";     shift 2 ;;
        --mode)    MODE="$2";      shift 2 ;;
        --yaml)    YAML_FILE="$2"; shift 2 ;;
        *) echo "Unknown option: $1"; exit 1 ;;
    esac
done
export MODEL_DIR="$MODEL"
export YAML="${SCRIPT_PATH}/../../models/${MODEL}/config/${YAML_FILE}"
if [ ! -f "$YAML" ]; then echo "[ERROR] YAML not found: $YAML"; exit 1; fi
echo "====================> launch offline inference (model=${MODEL}, yaml=${YAML_FILE})"
launch "$MODE"
"""

UTILS_INIT = '''"""STAND-IN of executor/utils."""
import logging

import yaml


def read_yaml(yaml_file_path):
    with open(yaml_file_path, "r", encoding="utf-8") as file:
        return yaml.safe_load(file)
'''

LOGGING_CONFIG = '''"""STAND-IN of executor/utils/logging_config.py (same format)."""
import logging

LOG_FORMAT = "[%(levelname)s][%(asctime)s.%(msecs)03d][%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(level=logging.INFO):
    root = logging.getLogger()
    root.handlers.clear()
    logging.basicConfig(format=LOG_FORMAT, datefmt=DATE_FORMAT, level=level)
'''

SCHEDULER = '''"""STAND-IN of executor/core/scheduler/scheduler.py: the per-step timing line."""
import logging

logger = logging.getLogger(__name__)


def log_step(is_prefill, seconds):
    stage = "prefill" if is_prefill else "decode"
    logger.info(f"[Main] Inference time ({stage}): {seconds * 1000:.2f} ms")
'''

MODEL_RUNNER = '''"""STAND-IN of executor/model_runner.py (legacy ModelRunner): transformers on CPU, same log lines."""
import logging
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

root_logger = logging.getLogger()
root_logger.handlers.clear()
logging.basicConfig(format='%(asctime)s - %(levelname)s - [LLM](%(filename)s:%(lineno)d): %(message)s',
                    level=logging.INFO)


class ModelRunner:
    def __init__(self, runner_settings):
        self.runner_settings = runner_settings
        self.model_name = runner_settings.get("model_name", "default_model_name")
        self.model_path = runner_settings.get("model_path")
        data_config = runner_settings.get("data_config", {})
        self.input_max_len = data_config.get("input_max_len", 1024)
        self.max_new_tokens = data_config.get("max_new_tokens", 32)
        self.batch_size = data_config.get("batch_size", 1)
        self.execute_mode = runner_settings.get("exe_mode", "eager")
        self.local_rank = int(os.getenv("LOCAL_RANK", "0"))
        self.device = torch.device("cpu")
        self.model = None
        self.tokenizer = None

    def init_model(self, model=None, config=None):
        logging.info("Try to load pretrained model in path: %s", self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def model_inference(self, model_inputs, is_prefill, warm_up=False):
        start_time = time.time()
        with torch.no_grad():
            outputs = self.model(**model_inputs)
        inference_time = time.time() - start_time
        inference_stage = "prefill" if is_prefill else "decode"
        logging.info(f"{self.model_name} inference time cost of {inference_stage} is {(inference_time)*1000:.2f} ms")
        return outputs, inference_time

    def model_generate(self, input_dict, input_lens, warm_up=False):
        logging.info("Prompt lens is : %d", input_lens)
        cnt = 0
        infer_time_rec = []
        while not ((warm_up and cnt >= 2) or cnt >= self.max_new_tokens):
            model_inputs = self.model_input_prepare(input_dict)
            outputs, inference_time = self.model_inference(model_inputs, is_prefill=input_dict["is_prefill"],
                                                           warm_up=warm_up)
            self.model_output_process(model_inputs, outputs, input_dict)
            cnt += 1
            infer_time_rec.append(inference_time)
        if not warm_up:
            avg = sum(infer_time_rec[1:]) / max(1, len(infer_time_rec) - 1)
            logging.info(f"{self.model_name} average inference time cost is {(avg)*1000:.2f} ms")
        generate_ids = input_dict["generate_ids"][:, input_lens:]
        res = self.tokenizer.batch_decode(generate_ids, skip_special_tokens=True)
        logging.info("Inference decode result for batch 0: \\n%s", res[0])
        return res
'''

OFFLINE_INFER = '''"""STAND-IN of executor/offline/infer.py (framework mode): transformers on CPU, same log lines."""
import argparse
import logging
import os
import time

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from executor.core.scheduler import log_step
from executor.utils.logging_config import setup_logging

logger = logging.getLogger(__name__)
PROMPT = "%(prompt)s"


def parse_args():
    parser = argparse.ArgumentParser(description="llm run parameters")
    parser.add_argument("--yaml_file_path", type=str, required=True, help="inference configurations")
    return parser.parse_args()


def generate(model, input_ids, max_new_tokens, timed):
    past, ids, times = None, input_ids, []
    out_ids = []
    for step in range(max_new_tokens):
        start = time.time()
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
        seconds = time.time() - start
        if timed:
            log_step(step == 0, seconds)
            times.append(seconds)
        past = out.past_key_values
        ids = out.logits[:, -1:].argmax(-1)
        out_ids.append(ids)
    return torch.cat(out_ids, dim=-1), times


def main():
    setup_logging()
    args = parse_args()
    with open(args.yaml_file_path, "r") as f:
        config = yaml.safe_load(f)
    model_config = config["model_config"]
    scheduler_config = config.get("scheduler_config", {})
    data_config = config.get("data_config", {})
    logger.info("Inference Configuration")
    logger.info(config)
    tokenizer = AutoTokenizer.from_pretrained(model_config["model_path"])
    model = AutoModelForCausalLM.from_pretrained(model_config["model_path"], dtype=torch.float32).eval()
    batch_size = scheduler_config.get("batch_size", 1)
    encoded = tokenizer([PROMPT] * batch_size, return_tensors="pt", truncation=True,
                        max_length=data_config.get("input_truncated_len", 256))
    generate(model, encoded.input_ids, 2, timed=False)       # engine.warm_up(): no timing lines
    out_ids, infer_time = generate(model, encoded.input_ids, scheduler_config.get("max_new_tokens", 8), timed=True)
    for i in range(batch_size):
        logger.info("Request %%s: outputs: %%s\\n", i, tokenizer.decode(out_ids[i], skip_special_tokens=True))
    decode = infer_time[1:]
    logger.info("%%s decode average inference time cost is %%.2f ms", model_config["model_name"],
                sum(decode) / max(1, len(decode)) * 1000)


if __name__ == "__main__":
    main()
''' % {"prompt": PROMPT}

# ---- a legacy recipe -----------------------------------------------------------------------
LEGACY_INFER_SH = """# coding=utf-8
# A recipe in the cann-recipes-infer legacy layout (its own infer.sh sourcing the shared launch).

#!/bin/bash
SCRIPT_PATH=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" &>/dev/null && pwd)
SET_ENV_ABS_PATH="${{SCRIPT_PATH}}/../../executor/scripts/set_env.sh"
FUNCTION_ABS_PATH="${{SCRIPT_PATH}}/../../executor/scripts/function.sh"
SET_ENV_ABS_PATH=$(realpath "${{SET_ENV_ABS_PATH}}")
FUNCTION_ABS_PATH=$(realpath "${{FUNCTION_ABS_PATH}}")

source ${{SET_ENV_ABS_PATH}}
source ${{FUNCTION_ABS_PATH}}

export MODEL_DIR=$(basename "$SCRIPT_PATH")
export YAML_PARENT_PATH="${{SCRIPT_PATH}}/config"
export YAML_FILE_NAME={name}.yaml  # modify to your yaml file name
export YAML=${{YAML_PARENT_PATH}}/${{YAML_FILE_NAME}}

launch
"""

LEGACY_INFER_PY = '''# coding=utf-8
import argparse
import logging
import os

from executor.utils import read_yaml
from runner_{name} import {cls}Runner

PROMPTS = ["{prompt}"]


def parse_args():
    parser = argparse.ArgumentParser(description="llm run parameters")
    parser.add_argument('--yaml_file_path', type=str, help="inference configurations")
    return parser.parse_args()


def run_{name}(runner_settings):
    model_runner = {cls}Runner(runner_settings)
    model_runner.init_model()
    # warm up
    model_runner.model_generate(PROMPTS, warm_up=True)
    # generate perf data
    model_runner.model_generate(PROMPTS)


if __name__ == "__main__":
    args = parse_args()
    runner_settings = read_yaml(args.yaml_file_path)
    logging.info(f"runner_settings is: {{runner_settings}}")
    run_{name}(runner_settings)
    logging.info("model run success")
'''

LEGACY_RUNNER = '''# coding=utf-8
import torch

from executor.model_runner import ModelRunner
{extra_import}

class {cls}Runner(ModelRunner):
    def model_input_prepare(self, input_dict):
        if input_dict["is_prefill"]:
            return {{"input_ids": input_dict["input_ids"], "use_cache": True}}
        return {{"input_ids": input_dict["input_ids"][:, -1:], "past_key_values": input_dict["past_key_values"],
                "use_cache": True}}

    def model_output_process(self, model_inputs, outputs, input_dict):
        next_token = outputs.logits[:, -1:].argmax(-1)
        input_dict["past_key_values"] = outputs.past_key_values
        input_dict["input_ids"] = torch.cat([input_dict["input_ids"], next_token], dim=-1)
        input_dict["generate_ids"] = input_dict["input_ids"]
        input_dict["is_prefill"] = False

    def model_generate(self, prompts, warm_up=False):
        inputs = self.tokenizer(prompts, return_tensors="pt", truncation=True, max_length=self.input_max_len)
        input_dict = {{"input_ids": inputs.input_ids, "generate_ids": inputs.input_ids, "is_prefill": True,
                      "past_key_values": None}}
        return super().model_generate(input_dict, inputs.input_ids.shape[1], warm_up=warm_up)
'''

LEGACY_YAML = """model_name: "{name}"
model_path: "{model_path}"
exe_mode: "eager"        # ["eager"]
world_size: 1

model_config:
  enable_profiler: False  # [False, True]
  enable_online_split_weight: True

data_config:
  dataset: "default"  # ["default", "LongBench"]
  input_max_len: 32
  max_new_tokens: 8
  batch_size: 1

parallel_config:
  attn_tp_size: 1
  moe_tp_size: 1
  lmhead_tp_size: 1
"""

FW_YAML = """model_name: "{name}"
world_size: 1  # keep it for backward compatibility.

model_config:
  model_name: "{name}"
  model_path: "{model_path}"
  exe_mode: "{exe_mode}"          # ["eager", "ge_graph", "npugraph_ex"]
  with_ckpt: True
  enable_profiler: false

data_config:
  dataset: "default"
  input_truncated_len: 32

parallel_config:
  world_size: 1
  attn_tp_size: 1

scheduler_config:
  max_new_tokens: 8
  batch_size: 1
"""

NPU_MODELING = '''# coding=utf-8
import torch
import torch_npu
from torch import nn


class {cls}RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        torch.npu.synchronize()
        return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]


def rotary(q, k, cos, sin):
    q = q.npu()
    return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)


def attention(q, k, v, mask):
    return torch.ops.npu.npu_fused_infer_attention_score(q, k, v, atten_mask=mask)
'''


def _write(path: Path, text: str, mode: int | None = None, newline: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    if mode is not None:
        path.chmod(mode)
    return path


def write_executor(root: Path) -> None:
    ex = root / "executor"
    _write(ex / "__init__.py", "")
    _write(ex / "scripts" / "set_env.sh", SET_ENV_SH, 0o755)
    _write(ex / "scripts" / "function.sh", FUNCTION_SH, 0o755)
    _write(ex / "scripts" / "infer.sh", ENTRY_INFER_SH, 0o755)
    _write(ex / "utils" / "__init__.py", UTILS_INIT)
    _write(ex / "utils" / "logging_config.py", LOGGING_CONFIG)
    _write(ex / "core" / "__init__.py", "")
    _write(ex / "core" / "scheduler.py", SCHEDULER)
    _write(ex / "model_runner.py", MODEL_RUNNER)
    _write(ex / "offline" / "__init__.py", "")
    _write(ex / "offline" / "infer.py", OFFLINE_INFER)


def _cls(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def write_legacy_recipe(root: Path, name: str, checkpoint: Path, npu_kernels: bool = False,
                        newline: str = "\n") -> Path:
    recipe = root / "models" / name
    cls = _cls(name)
    _write(recipe / "infer.sh", LEGACY_INFER_SH.format(name=name), 0o755, newline)
    _write(recipe / "infer.py", LEGACY_INFER_PY.format(name=name, cls=cls, prompt=PROMPT), None, newline)
    _write(recipe / "runner_" f"{name}.py", LEGACY_RUNNER.format(
        cls=cls, extra_import=f"from models.modeling_{name} import {cls}RMSNorm\n" if npu_kernels else ""),
        None, newline)
    _write(recipe / "config" / f"{name}.yaml", LEGACY_YAML.format(name=name, model_path=checkpoint), None, newline)
    _write(recipe / "README.md", f"# {name}\n\nRun `bash infer.sh`.\n", None, newline)
    if npu_kernels:
        _write(recipe / "models" / f"modeling_{name}.py", NPU_MODELING.format(cls=cls), None, newline)
    return recipe


def write_framework_recipe(root: Path, name: str, checkpoint: Path, npu_kernels: bool = False,
                           exe_mode: str = "eager") -> Path:
    recipe = root / "models" / name
    _write(recipe / "config" / f"{name}_rank_1_{exe_mode}.yaml",
           FW_YAML.format(name=name, model_path=checkpoint, exe_mode=exe_mode))
    _write(recipe / "README.md", f"# {name}\n\n```\nbash executor/scripts/infer.sh --model {name} "
                                 f"--yaml {name}_rank_1_{exe_mode}.yaml\n```\n")
    if npu_kernels:
        _write(recipe / "models" / f"modeling_{name}.py", NPU_MODELING.format(cls=_cls(name)))
    return recipe


def write_repo(root: Path, checkpoint: Path) -> dict[str, Path]:
    """The whole tree; returns {name: recipe folder}."""
    root.mkdir(parents=True, exist_ok=True)
    write_executor(root)
    (root / "README.md").write_text("# cann-recipes-infer (stand-in)\n")
    return {
        "legacy_llama": write_legacy_recipe(root, "legacy_llama", checkpoint),
        "fw_llama": write_framework_recipe(root, "fw_llama", checkpoint),
        "npu_legacy": write_legacy_recipe(root, "npu_legacy", checkpoint, npu_kernels=True, newline="\r\n"),
        "npu_fw": write_framework_recipe(root, "npu_fw", checkpoint, npu_kernels=True, exe_mode="ge_graph"),
    }


def tree_bytes(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mode under `folder` (to prove nothing changed)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mode)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tree_paths(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


__all__ = ["write_repo", "write_legacy_recipe", "write_framework_recipe", "write_executor", "tree_bytes",
           "tree_paths", "PROMPT"]
