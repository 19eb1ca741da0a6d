"""Parity check: the recipe's vendored model vs the original transformers implementation.

The code is checked on a shrunk config of the same architecture (fp32, random weights: max |logits
difference| on a prompt, and the recipe Runner's greedy tokens vs `generate()`'s); the run itself, on
the real weights, is held to transformers step by step by agent.measure.precision. Runs in a
subprocess from the recipe dir (its `models` package must not leak into the caller), as
`python -m agent.measure.parity --recipe DIR`, printing one JSON object (`--nll CHECKPOINT`: only how
well the checkpoint's own model predicts the default prompt, for a recipe not on this engine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from agent.recipe.shrink import shrink_config
from agent.recipe.targets import state_dir
from agent.child_failure import child_failure, one_line
from agent.processes import owned_temp, run_tree, stop_leftovers
from agent.recipe.recipe import Recipe, runner_files
from engine.config import load_runner_settings
from engine.data import DEFAULT_PROMPT
from engine.environment import import_torch
from engine.safe_load import load_json, loads_json

LOGITS_TOLERANCE = 1e-4


def run_parity(recipe: Recipe, tokens: int = 16, timeout: int = 900, trust_remote_code: bool = False,
               yaml: Path | None = None) -> dict:
    """`check` in a subprocess from the recipe folder (its `models` package must not leak into the
    caller), on `yaml` (the run plan's; default: the recipe's own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(recipe.path), env.get("PYTHONPATH")]))
    env.pop("MIGRATOR_PARITY_DUMP", None)
    cmd = [sys.executable, "-m", "agent.measure.parity", "--recipe", str(recipe.path), "--tokens", str(tokens)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if yaml is not None:
        cmd += ["--yaml", str(yaml)]
    # one process tree the migrator owns: stopped with it on SIGINT / SIGTERM or the timeout, and by
    # the next check when a SIGKILLed migrator left it running
    runs = state_dir(recipe.path) / "runs"
    pids = runs / "parity.pids" if runs.is_dir() and not runs.is_symlink() else None
    if pids is not None:
        stop_leftovers(pids, recipe.path)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err_file:
        tree = run_tree(cmd, cwd=recipe.path, env=env, stdout=out, stderr=err_file, timeout=timeout, pids_file=pids,
                        pids_root=recipe.path)
        out.seek(0)
        err_file.seek(0)
        stdout, stderr = out.read(), err_file.read()
    lines = stdout.strip().splitlines()
    if tree.returncode != 0 or not lines:
        err = child_failure(stderr, tree.returncode, timed_out=tree.timed_out, timeout_s=timeout,
                            no_answer="it printed no verdict")
        return {"ok": False, "checked": False, "reason": f"parity check could not run: {err}"}
    return loads_json(lines[-1])


def parity_not_applicable(recipe: Recipe, timeout: int = 600) -> dict:
    """A recipe written for another runtime (cann-recipes-infer's executor): its model code is not
    ours to compare against transformers, so parity is not applicable; whether the checkpoint's
    weights are trained (random weights write noise by design) is still judged from the checkpoint,
    in a subprocess (`--nll`)."""
    result = {"ok": None, "checked": False,
              "reason": "not a recipe on this tool's engine (e.g. a cann-recipes-infer recipe): parity not applicable"}
    model_dir = recipe.checkpoint_dir()
    if model_dir is None:
        return result
    try:
        # one process tree the migrator owns (stopped with it on SIGINT / SIGTERM or the timeout)
        with tempfile.TemporaryFile("w+") as out:
            tree = run_tree([sys.executable, "-m", "agent.measure.parity", "--nll", str(model_dir)], cwd=recipe.path,
                            env=dict(os.environ), stdout=out, stderr=subprocess.DEVNULL, timeout=timeout)
            out.seek(0)
            text = out.read().strip()
        if tree.returncode == 0 and text:
            result.update(loads_json(text.splitlines()[-1]))
    except (OSError, ValueError, subprocess.SubprocessError):   # optional: never fail a baseline over it
        pass
    return result


def checkpoint_nll(model_path: Path) -> dict:
    """prompt_nll of transformers' own model of the checkpoint (fp32) on the default prompt."""
    import torch
    from transformers import AutoTokenizer

    from agent.recipe.text_decoder import transformers_auto_class

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = transformers_auto_class(model_path).from_pretrained(model_path, dtype=torch.float32,
                                                                local_files_only=True).eval()
    ids = tokenizer([DEFAULT_PROMPT], return_tensors="pt")
    with torch.inference_mode():
        logits = model(**ids).logits
    return prompt_nll(logits, ids["input_ids"])


def _runner_class(recipe_dir: Path):
    import importlib

    from engine.model_runner import ModelRunner

    name = runner_files(recipe_dir)[0].stem
    module = importlib.import_module(name)
    return next(obj for obj in vars(module).values()
                if isinstance(obj, type) and issubclass(obj, ModelRunner) and obj is not ModelRunner)


def check(recipe_dir: Path, tokens: int, prompt: str | None = None, trust_remote_code: bool = False,
          yaml: Path | None = None) -> dict:
    """The vendored classes vs transformers on a shrunk config of the same architecture
    (`agent.recipe.shrink`), random fp32 weights: max |logits diff| <= 1e-4, same greedy tokens.
    `yaml`: the run plan's YAML (default: the recipe's own)."""
    settings = load_runner_settings(yaml or Recipe.at(recipe_dir).yaml)
    from agent.migrate.vendor import runs_remote_code

    remote = runs_remote_code(load_json(Path(settings["model_path"]) / "config.json"), trust_remote_code)
    if remote and not trust_remote_code:
        # The original implementation is the repo's own code: never run it without the opt-in.
        return {"ok": None, "checked": False,
                "reason": "original implementation is remote code; pass --trust-remote-code to compare"}
    settings["world_size"] = 1          # one process, one prompt: parity is not a parallel run
    settings["parallel_config"] = {key: 1 for key in settings["parallel_config"]}
    sys.path.insert(0, str(recipe_dir))
    return check_code(recipe_dir, settings, tokens, prompt, remote)


def _runner(recipe_dir: Path, settings: dict):
    runner = _runner_class(recipe_dir)(settings)
    runner.init_model()
    return runner


def shrunk_reference(model_path: Path, overrides: dict, remote: bool, tiny: Path):
    """transformers' own model on a shrunk copy of the checkpoint's config, random fp32 weights saved
    in `tiny` beside the checkpoint's tokenizer: (the model, the shrunk values), or (None, why not)."""
    import torch
    from transformers import AutoConfig

    from agent.recipe.text_decoder import transformers_auto_class

    for item in model_path.iterdir():   # tokenizer, generation config, the repo's own code
        if _copied_to_shrunk(item):
            shutil.copy(item, tiny / item.name)
    original = load_json((model_path / "config.json"))
    # Fewer layers first; a config whose layer counts a cut breaks keeps them all (widths only).
    for cut_layers in (True, False):
        config = copy.deepcopy(original)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        shrunk = shrink_config(text, cut_layers=cut_layers)
        text.update(shrunk)
        config.update(overrides)
        (tiny / "config.json").write_text(json.dumps(config))
        try:
            cfg = AutoConfig.from_pretrained(tiny, trust_remote_code=remote, local_files_only=True)
            torch.manual_seed(0)
            reference = transformers_auto_class(model_path).from_config(cfg, trust_remote_code=remote,
                                                                        dtype=torch.float32)
            if cut_layers:   # a cut transformers' own model cannot run is no shrink of it (hrm_text)
                with torch.inference_mode():
                    reference(input_ids=torch.tensor([[1, 2, 3]]))
            reference.save_pretrained(tiny, safe_serialization=True)
            return reference, shrunk
        except Exception as exc:  # noqa: BLE001 - transformers itself cannot build the shrunk config
            error = exc
    return None, {"ok": None, "checked": False, "shrunk": shrunk,
                  "reason": f"transformers cannot build the shrunk config: {type(error).__name__}: {error}"[:300]}


STAGE_NOTE = "parity stage: "      # an exception's note naming what the check was doing when it was raised


def check_code(recipe_dir: Path, settings: dict, tokens: int, prompt: str | None, remote: bool) -> dict:
    """Vendored code vs transformers on a shrunk config, fp32, random weights (size-independent).
    A failure is raised with a note of the stage it happened in; a check whose temporary copy lost its
    files while it ran (another process removed them) did not run, and says so."""
    with owned_temp("parity_code") as tmp:
        stage = ["building transformers' model on a shrunk config"]
        try:
            return _check_code(recipe_dir, settings, tokens, prompt, remote, Path(tmp), stage)
        except Exception as exc:
            lost = lost_inputs(Path(settings["model_path"]), Path(tmp))
            if lost:
                return {"ok": None, "checked": False,
                        "reason": one_line(f"did not run: its temporary copy of the checkpoint lost {', '.join(lost[:4])} "
                                           f"while {stage[0]} (another process removed them; run it again): "
                                           f"{type(exc).__name__}: {exc}")}
            exc.add_note(STAGE_NOTE + stage[0])
            raise


def lost_inputs(model_path: Path, tiny: Path) -> list[str]:
    """The files the shrunk copy took from the checkpoint (tokenizer, configs) that are no longer in it."""
    copied = [item.name for item in model_path.iterdir() if _copied_to_shrunk(item)] if model_path.is_dir() else []
    return sorted(name for name in copied + ["config.json"] if not (tiny / name).is_file())


def _copied_to_shrunk(item: Path) -> bool:
    return item.is_file() and not item.name.endswith((".safetensors", ".bin", ".index.json", ".pt", ".pth"))


def _check_code(recipe_dir: Path, settings: dict, tokens: int, prompt: str | None, remote: bool, tmp: Path,
                stage: list[str]) -> dict:
    import torch
    from transformers import GenerationConfig

    reference, shrunk = shrunk_reference(Path(settings["model_path"]),
                                         settings["model_config"].get("config_overrides", {}), remote, tmp)
    if reference is None:
        return shrunk
    tiny_settings = copy.deepcopy(settings)
    tiny_settings["model_path"] = str(tmp)
    tiny_settings["world_size"] = 1
    tiny_settings["model_config"]["dtype"] = "float32"
    # key_mapping stays: the reference class saves these weights under the names the checkpoint has.
    tiny_settings["model_config"]["config_overrides"] = {}
    data = tiny_settings["data_config"]
    data["input_max_len"] = max(1, min(data["input_max_len"], data["input_max_len"] + data["max_new_tokens"] - tokens))
    data["max_new_tokens"] = tokens
    stage[0] = "loading the recipe's model and tokenizer from the shrunk copy"
    runner = _runner(recipe_dir, tiny_settings)
    reference = reference.to(runner.device).eval()
    reference.config._attn_implementation = runner.attn_implementation   # noqa: SLF001 - same kernels on both sides
    prompt = prompt or DEFAULT_PROMPT
    stage[0] = "running the recipe's model on the prompt"
    inputs = runner.tokenizer([prompt], return_tensors="pt").to(runner.device)
    with torch.inference_mode():
        ours = runner.model(**inputs).logits.float()
    try:
        with torch.inference_mode():
            theirs = reference(**inputs).logits.float()
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot run it: nothing to compare
        return {"ok": None, "checked": False, "shrunk": shrunk, "reason": _reference_failed("run", exc)}
    max_abs_diff = (ours - theirs).abs().max().item()
    stage[0] = "the recipe's greedy generation"
    runner.model_generate([prompt])
    our_tokens = runner.last_generate_ids[0].tolist()
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=tokens, eos_token_id=runner.eos_token_ids() or None,
                                  pad_token_id=runner.tokenizer.pad_token_id)
    try:
        with torch.inference_mode():
            generated = reference.generate(**inputs, generation_config=gen_config)
    except Exception as exc:  # noqa: BLE001 - as above: transformers' own generate fails here
        return {"ok": None, "checked": False, "shrunk": shrunk, "max_abs_logits_diff": max_abs_diff,
                "reason": _reference_failed("generate", exc)}
    their_tokens = generated[0, inputs["input_ids"].shape[1]:].tolist()
    tokens_equal = our_tokens == their_tokens
    return {"ok": max_abs_diff <= LOGITS_TOLERANCE and tokens_equal, "checked": True, "dtype": "float32",
            "shrunk": shrunk, "reference": f"transformers {reference.__class__.__name__}",
            "max_abs_logits_diff": max_abs_diff, "tolerance": LOGITS_TOLERANCE,
            "greedy_tokens": len(our_tokens), "greedy_tokens_equal": tokens_equal,
            "recipe_tokens": our_tokens, "reference_tokens": their_tokens}


def _reference_failed(what: str, exc: Exception) -> str:
    return one_line(f"the reference (transformers) fails to {what} on this checkpoint: {type(exc).__name__}: {exc}")


# Random weights predict the prompt no better than chance (or worse: random logits are peaked);
# a trained model is far below the uniform cross-entropy ln(vocab).
UNTRAINED_NLL_FRACTION = 0.8


def prompt_nll(logits, input_ids) -> dict:
    """Mean next-token cross-entropy of the prompt vs the uniform distribution's ln(vocab)."""
    import math

    import torch

    vocab = logits.shape[-1]
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), input_ids[0, 1:]).item()
    uniform = math.log(vocab)
    return {"prompt_nll": round(nll, 4), "uniform_nll": round(uniform, 4),
            "untrained_weights": nll >= UNTRAINED_NLL_FRACTION * uniform}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.measure.parity", description=__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--recipe", type=Path)
    what.add_argument("--nll", type=Path, metavar="CHECKPOINT", help="only prompt_nll of the checkpoint's own model")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--yaml", type=Path, help="the run plan's YAML (default: the recipe's own)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--dump", type=Path, help="the trial run's parity dump (MIGRATOR_PARITY_DUMP): whether the "
                        "weights are untrained, where transformers cannot say")
    args = parser.parse_args(argv)
    # torch through the engine's guard, as the recipe imports it: with a torch_npu that cannot load
    # (no CANN) a plain `import torch` dies in torch's backend autoload.
    import_torch()
    if args.nll:
        print(json.dumps(checkpoint_nll(args.nll)))
        return 0
    # The recipe's logs go to a temporary folder that is removed afterwards.
    with owned_temp("parity") as res_path:
        os.environ["RES_PATH"] = str(res_path)
        try:
            result = check(args.recipe.resolve(), args.tokens, trust_remote_code=args.trust_remote_code, yaml=args.yaml)
        except Exception as exc:  # noqa: BLE001 - only transformers' own failures are answered here
            result = transformers_failed(exc, dump=args.dump)
            if result is None:
                raise
    print(json.dumps(result))
    return 0


def _raised_by_transformers(exc: BaseException) -> bool:
    """The innermost frame of `exc` outside torch and the standard library is transformers' own code."""
    import traceback

    import transformers

    package = Path(transformers.__file__).resolve().parent
    frames = [Path(f.filename).resolve() for f in traceback.extract_tb(exc.__traceback__)]
    # transformers' frames and the code of this tool or the recipe; torch and other libraries are skipped
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    kept = [f for f in frames if package in f.parents or ("site-packages" not in f.parts and stdlib not in f.parents)]
    return bool(kept) and package in kept[-1].parents


def transformers_failed(exc: Exception, what: str = "config", dump: Path | None = None) -> dict | None:
    """A check that failed inside transformers on this config / checkpoint: no verdict, one line naming
    the stage it was in (the note check_code added) and transformers' whole error, and whether the weights
    are untrained judged from the recipe's own run (the trial run's dump), which needs no reference.
    None: not transformers' failure."""
    if not _raised_by_transformers(exc):
        return None
    stage = next((note[len(STAGE_NOTE):] for note in getattr(exc, "__notes__", ()) if note.startswith(STAGE_NOTE)),
                 None)
    return {"ok": None, "checked": False, "reference": None,
            "reason": one_line(f"did not run: transformers failed on this {what}" + (f" while {stage}" if stage else "")
                               + f": {type(exc).__name__}: {exc}"),
            **dump_nll(dump)}


def dump_nll(dump: Path | None) -> dict:
    """prompt_nll / uniform_nll / untrained_weights of the recipe's own prompt logits, from the trial
    run's parity dump (engine.parity_dump); {} without a complete one."""
    import torch

    if dump is None or not Path(dump).is_file():
        return {}
    try:
        data = torch.load(dump, weights_only=True)
        nll, uniform = float(data["prompt_nll"]), float(data["uniform_nll"])
    except Exception:  # noqa: BLE001 - a partial dump of a killed run: nothing to say
        return {}
    return {"prompt_nll": round(nll, 4), "uniform_nll": round(uniform, 4),
            "untrained_weights": nll >= UNTRAINED_NLL_FRACTION * uniform}


if __name__ == "__main__":
    sys.exit(main())
