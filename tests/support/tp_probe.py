"""Probe for tests/e2e/test_tensor_parallel.py (not a test module): load a recipe through its runner
under the given parallel sizes, write per rank the logits of a fixed input, the greedy tokens and
the weight bytes it holds.

    [torchrun --nproc-per-node N] tp_probe.py RECIPE OUT_DIR TP [MOE_TP LMHEAD_TP]
"""

import importlib
import json
import os
import sys
from pathlib import Path

recipe, out_dir, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
moe_tp, lmhead_tp = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (tp, tp)
sys.path.insert(0, str(recipe))

import torch  # noqa: E402

from engine.config import load_runner_settings  # noqa: E402

settings = load_runner_settings(next((recipe / "config").glob("*.yaml")))
settings["world_size"] = int(os.environ.get("WORLD_SIZE", 1))
settings["parallel_config"] = {"attn_tp_size": tp, "moe_tp_size": moe_tp, "lmhead_tp_size": lmhead_tp}
settings["data_config"]["max_new_tokens"] = 6
from models.model_setting import check_vars, update_vars  # noqa: E402

check_vars(settings)
update_vars(settings)
module = importlib.import_module(f"runner_{settings['model_name']}")
runner_cls = next(v for k, v in vars(module).items() if k.endswith("Runner") and k != "ModelRunner")
runner = runner_cls(settings)
runner.init_model()

ids = torch.tensor([[5, 17, 42, 7, 99, 8, 23, 11]])
with torch.inference_mode():
    logits = runner.model(input_ids=ids).logits[0].float()
runner.model_generate(["The quick brown fox"])
local_bytes = {}
for name, param in runner.model.named_parameters():
    data = param.to_local() if hasattr(param, "to_local") else param
    local_bytes[name] = data.numel() * data.element_size()
record = {"rank": runner.rank, "logits": logits.tolist(), "tokens": runner.last_generate_ids[0].tolist(),
          "held_bytes": runner.model_bytes, "param_bytes": local_bytes}
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{runner.rank}.json").write_text(json.dumps(record))
runner.close()
