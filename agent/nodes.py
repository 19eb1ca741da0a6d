"""The workflow's nodes: each takes the state and returns the keys it changes (SPEC §2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

from agent.errors import EnvironmentProblem, InputError, MigratorError


class MigrationState(TypedDict, total=False):
    # inputs
    target: str                 # what the user gave: link, Org/Name, checkpoint dir or recipe dir
    output_dir: str
    name: str | None
    device: str
    dtype: str | None
    weights: str | None
    trust_remote_code: bool
    allow_install: bool
    max_rounds: int
    timeout_s: int
    max_new_tokens: int
    world_size: int             # --world-size: cards for one tensor-parallel run (default 1)
    # derived
    env: dict
    scenario: str               # "A" migrate, "B" repair, "C" baseline
    classify_reason: str
    recipe_dir: str
    model_name: str
    model_dir: str              # local checkpoint directory
    model_source: str           # link or path recorded in the baseline
    architecture: str
    family: str
    vendored: dict
    rendered: list[str]
    runs: list[dict]            # every trial run, in order
    rounds: list[dict]          # repair rounds: diagnosis, diff
    memory: dict
    baseline_path: str
    verification: dict
    status: str                 # "ok" | "failed" | "oom" | ...
    message: str


def node_detect_env(state: MigrationState) -> dict:
    from engine.environment import DeviceUnavailableError, detect_environment, select_device

    device = state.get("device", "auto")
    try:
        select_device(device)
    except DeviceUnavailableError as exc:
        raise EnvironmentProblem(str(exc)) from exc
    return {"env": detect_environment(device)}


def _is_recipe(path: Path) -> bool:
    return (path / "infer.sh").is_file()


def node_classify(state: MigrationState) -> dict:
    """No infer.sh -> A; infer.sh that runs -> C; infer.sh that fails -> B."""
    target = Path(state["target"]).expanduser()
    if target.is_dir() and _is_recipe(target):
        run = trial_run(target, state, label="classify")
        if run["ok"]:
            return {"scenario": "C", "classify_reason": "infer.sh present and it runs",
                    "recipe_dir": str(target.resolve()), "runs": [run]}
        return {"scenario": "B", "classify_reason": f"infer.sh present but it fails: {run['summary']}",
                "recipe_dir": str(target.resolve()), "runs": [run]}
    return {"scenario": "A", "classify_reason": "no infer.sh: migrate the model into a new recipe"}


def node_acquire(state: MigrationState) -> dict:
    from agent.acquire import acquire
    from agent.render import normalise_model_name

    got = acquire(state["target"], weights=state.get("weights"))
    name = state.get("name") or normalise_model_name(got.name_hint)
    if state.get("name"):
        name = normalise_model_name(name)
    recipe_dir = Path(state.get("output_dir") or "models").resolve() / name
    if recipe_dir.exists() and any(recipe_dir.iterdir()):
        raise InputError(f"{recipe_dir} already exists; run `migrator run {recipe_dir}` to repair or "
                         "re-baseline it, or choose another --name / --output-dir")
    return {"model_dir": str(got.model_dir), "model_source": got.source, "model_name": name,
            "recipe_dir": str(recipe_dir)}


def node_vendor(state: MigrationState) -> dict:
    from agent.routing import route
    from agent.vendor import locate_source, read_config, vendor_source

    model_dir = Path(state["model_dir"])
    config = read_config(model_dir)
    source = locate_source(config, model_dir, trust_remote_code=bool(state.get("trust_remote_code")))
    family = route(config.get("text_config") or config)
    recipe_dir = Path(state["recipe_dir"])
    result = vendor_source(source, recipe_dir, state["model_name"])
    return {
        "architecture": source.architecture,
        "family": family.name,
        "vendored": {
            "model_class": source.model_class,
            "config_class": source.config_class,
            "modeling_module": source.modeling_module,
            "configuration_module": source.configuration_module,
            "origin": source.origin,
            "attn_implementation": source.attn_implementation,
            "files": {role: str(path.relative_to(recipe_dir)) for role, path in result.files.items()},
            "codemods": result.codemods,
        },
    }


def checkpoint_dtype(config: dict) -> str:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype if dtype in ("float32", "float16", "bfloat16") else "float32"


def input_max_len(config: dict, max_new_tokens: int, default: int = 1024) -> int:
    """Prompt budget: 1024 tokens, less when the model has fewer positions."""
    text = config.get("text_config") or config
    limit = text.get("max_position_embeddings") or text.get("n_positions") or text.get("max_sequence_length")
    return max(1, min(default, limit - max_new_tokens)) if limit else default


def node_render(state: MigrationState) -> dict:
    import transformers

    from agent.memory import parallel_settings
    from agent.render import render_recipe
    from agent.routing import FAMILIES
    from agent.vendor import read_config

    recipe_dir = Path(state["recipe_dir"])
    vendored = state["vendored"]
    config = read_config(Path(state["model_dir"]))
    context = {
        "model_name": state["model_name"],
        "model_path": str(Path(state["model_dir"]).resolve()),
        "model_source": state["model_source"],
        "architecture": state["architecture"],
        "device": state.get("device", "auto"),
        "dtype": state.get("dtype") or checkpoint_dtype(config),
        "input_max_len": input_max_len(config, state.get("max_new_tokens") or 32),
        "max_new_tokens": state.get("max_new_tokens") or 32,
        "transformers_version": transformers.__version__,
        "modeling_codemods": ", ".join(vendored["codemods"].get(f"modeling_{state['model_name']}.py", []))
        or "none",
        **{k: vendored[k] for k in ("model_class", "config_class", "modeling_module",
                                    "configuration_module", "origin", "attn_implementation")},
        # world_size, attn_tp_size, moe_tp_size, lmhead_tp_size (refuses a family without a TP plan)
        **parallel_settings(config, state.get("world_size") or 1),
    }
    written = render_recipe(recipe_dir, context, FAMILIES[state["family"]])
    return {"rendered": [str(p.relative_to(recipe_dir)) for p in written]}


def trial_run(recipe_dir: Path, state: MigrationState, label: str) -> dict:
    """`bash infer.sh` in a subprocess with a timeout; log and output kept under .migrator/runs/."""
    runs_dir = recipe_dir / ".migrator" / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    index = len(list(runs_dir.glob("run_*")))
    run_dir = runs_dir / f"run_{index}_{label}"
    run_dir.mkdir()
    env = dict(os.environ, RES_PATH=str(run_dir), PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    if (state.get("world_size") or 1) > 1:  # --world-size N: the N-card YAML (written if the recipe lacks it)
        env["YAML_FILE"] = str(_recipe_yaml(recipe_dir, state["world_size"]).relative_to(recipe_dir))
    timeout = state.get("timeout_s") or 1800
    start = time.perf_counter()
    with open(run_dir / "output.txt", "w") as out:
        try:
            # No stdin: a prompt (e.g. "run custom code? [y/N]") must fail, not wait forever.
            proc = subprocess.run(["bash", str(recipe_dir / "infer.sh")], cwd=recipe_dir, env=env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            returncode, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
    output = (run_dir / "output.txt").read_text(errors="replace")
    tail = output.strip().splitlines()[-1:] or [""]
    ok = returncode == 0 and not timed_out
    log = run_dir / "log_0.log"
    prefills = log.read_text(errors="replace").count("inference time cost of prefill") if log.is_file() else 0
    # A baseline needs a warm-up generation before the formal one: two prefills at least.
    if ok and prefills < 2:
        ok = False
        with open(run_dir / "output.txt", "a") as out:
            out.write(f"\nBaselineError: infer.py ran without a warm-up generation ({prefills} prefill in log_0.log)\n")
        output = (run_dir / "output.txt").read_text(errors="replace")
        tail = output.strip().splitlines()[-1:]
    summary = "ok" if ok else ("timed out after %ds" % timeout if timed_out else tail[0][-300:])
    return {"label": label, "ok": ok, "returncode": returncode, "timed_out": timed_out,
            "seconds": round(time.perf_counter() - start, 2), "res_path": str(run_dir),
            "output_file": str(run_dir / "output.txt"), "summary": summary}


def node_trial_run(state: MigrationState) -> dict:
    recipe_dir = Path(state["recipe_dir"])
    run = trial_run(recipe_dir, state, label=f"trial{len(state.get('rounds') or [])}")
    return {"runs": [*(state.get("runs") or []), run]}


def last_run(state: MigrationState) -> dict:
    return (state.get("runs") or [{}])[-1]


def node_diagnose(state: MigrationState) -> dict:
    from agent.repair import diagnose

    diagnosis = diagnose(Path(state["recipe_dir"]), last_run(state))
    rounds = [*(state.get("rounds") or []), {"round": len(state.get("rounds") or []) + 1,
                                              "diagnosis": diagnosis}]
    return {"rounds": rounds}


def node_repair(state: MigrationState) -> dict:
    from agent.repair import RepairContext, repair

    context = RepairContext(allow_install=bool(state.get("allow_install")), timeout_s=state.get("timeout_s") or 1800,
                            trust_remote_code=bool(state.get("trust_remote_code")))
    rounds = list(state["rounds"])
    rounds[-1] = dict(rounds[-1], **repair(Path(state["recipe_dir"]), rounds[-1]["diagnosis"],
                                           round_no=rounds[-1]["round"], context=context))
    return {"rounds": rounds}


def node_estimate_memory(state: MigrationState) -> dict:
    """After an out-of-memory run: the estimate per rank for tp = 1, 2, 4, ... 16 against one card;
    the single-card recipe is kept and the smallest N that fits is written as an N-card YAML."""
    from agent.memory import estimate_for_recipe, write_multicard_yaml

    recipe_dir = Path(state["recipe_dir"])
    memory = estimate_for_recipe(recipe_dir, state.get("env") or {})
    have = f"{memory['device_bytes'] / 2**30:.2f} GiB per {memory['device']} device" if memory["device_bytes"] \
        else "unknown device memory"
    message = (f"out of memory: needs about {memory['needed_gib']:.2f} GiB on one card (weights "
               f"{memory['weights_bytes'] / 2**30:.2f} GiB + KV cache {memory['kv_cache_bytes'] / 2**30:.2f} GiB "
               f"+ runtime) with {have}")
    cards = memory["cards_needed"]
    if cards and cards > 1:
        yaml_file = write_multicard_yaml(recipe_dir, cards)
        rank = memory["per_rank"][cards]
        command = f"cd {recipe_dir} && YAML_FILE=config/{yaml_file.name} bash infer.sh"
        memory.update(multicard_yaml=str(yaml_file.relative_to(recipe_dir)), multicard_command=command)
        message += (f"; {cards} cards fit (tensor parallel, {rank['needed_bytes'] / 2**30:.2f} GiB per rank): "
                    f"world_size: {cards} written to config/{yaml_file.name}, run it with `{command}` or "
                    f"`migrator run {recipe_dir} --world-size {cards}` (the single-card recipe is kept)")
        readme = recipe_dir / "README.md"
        if readme.is_file() and "## On more cards" not in readme.read_text():
            with open(readme, "a") as f:
                f.write(f"\n## On more cards\n\nThe model does not fit one card ({have}); on {cards} cards, "
                        f"tensor parallel (about {rank['needed_bytes'] / 2**30:.2f} GiB per rank):\n\n"
                        f"```bash\nYAML_FILE=config/{yaml_file.name} bash infer.sh\n```\n")
    elif memory["tp_sharded_bytes"] is None:
        message += f"; {memory.get('model_type')} has no tensor-parallel plan, so more cards do not help"
    elif cards is None and memory["device_bytes"]:
        message += f"; even {max(memory['per_rank'])} cards do not fit (lower batch_size / input_max_len, or a smaller dtype)"
    return {"memory": memory, "status": "oom", "message": message}


def node_collect_baseline(state: MigrationState) -> dict:
    from agent.paths import scripts_dir

    recipe_dir = Path(state["recipe_dir"])
    run = last_run(state)
    yaml_file = _recipe_yaml(recipe_dir, state.get("world_size") or 1)
    output = recipe_dir / "baseline" / "baseline_metadata.json"
    cmd = [sys.executable, str(scripts_dir() / "collect_baseline.py"), "--log-file", run["res_path"],
           "--output", str(output), "--yaml-file", str(yaml_file)]
    if state.get("model_source"):
        cmd += ["--model-source", state["model_source"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MigratorError(f"baseline collection failed: {proc.stderr.strip().splitlines()[-1:]}")
    return {"baseline_path": str(output)}


def _recipe_yaml(recipe_dir: Path, world_size: int = 1) -> Path:
    from agent.memory import recipe_yaml, write_multicard_yaml

    yamls = sorted((recipe_dir / "config").glob("*.yaml"))
    if not yamls:
        raise InputError(f"{recipe_dir}/config has no YAML file")
    found = recipe_yaml(recipe_dir, world_size)
    if world_size > 1 and not found.name.endswith(f"_{world_size}card_eager.yaml"):
        found = write_multicard_yaml(recipe_dir, world_size)
    return found


def node_verify(state: MigrationState) -> dict:
    """Parity against the original implementation when it is importable; merged into the baseline."""
    from agent.parity import run_parity

    recipe_dir = Path(state["recipe_dir"])
    baseline_path = Path(state["baseline_path"])
    baseline = json.loads(baseline_path.read_text())
    parity = run_parity(recipe_dir, trust_remote_code=bool(state.get("trust_remote_code")))
    baseline["verification"]["parity"] = parity
    check = baseline["verification"].get("output_check") or {}
    if parity.get("untrained_weights"):
        # Random weights write noise by design: judging the text would only say so.
        baseline["verification"]["output_check"] = dict(
            check, ok=None, skipped="untrained weights: text checks skipped, parity used")
    baseline_path.write_text(json.dumps(baseline, indent=2, ensure_ascii=False) + "\n")
    problems = []
    if not baseline["verification"].get("all_ranks_success", False):
        problems.append("not every rank finished its formal run")
    output_check = baseline["verification"].get("output_check") or {}
    if output_check.get("ok") is False:
        problems.append(f"abnormal output text: {'; '.join(output_check.get('reasons') or [])}")
    if parity.get("ok") is False:
        problems.append(f"parity check failed: {parity.get('reason') or _parity_numbers(parity)}")
    update = {"verification": baseline["verification"], "status": "failed" if problems else "ok"}
    if problems:
        update["message"] = "; ".join(problems)
    if output_check.get("ok") is False:
        # Abnormal text from trained weights goes back to diagnosis like a failed run.
        run = dict(last_run(state), label="verify", ok=False, summary="abnormal output")
        note = Path(run["res_path"]) / "output_check.txt"
        note.write_text(Path(run["output_file"]).read_text(errors="replace") +
                        f"\nOutputCheckError: {'; '.join(output_check.get('reasons') or [])}\n")
        run["output_file"] = str(note)
        update["runs"] = [*(state.get("runs") or []), run]
    return update


def _parity_numbers(parity: dict) -> str:
    return (f"max |logits diff| {parity.get('max_abs_logits_diff')} (tolerance {parity.get('tolerance')}), "
            f"greedy tokens equal: {parity.get('greedy_tokens_equal')}")


def node_report(state: MigrationState) -> dict:
    from agent.report import write_report

    write_report(state)
    return {}


def summarise(state: dict[str, Any]) -> dict:
    keys = ("scenario", "status", "message", "recipe_dir", "model_name", "architecture", "family",
            "baseline_path")
    return {k: state.get(k) for k in keys if state.get(k) is not None}
