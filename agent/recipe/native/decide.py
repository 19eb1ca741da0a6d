"""Native or adapter: derive the architecture's parts (agent.recipe.native.compose), write the native file from
them (agent.recipe.native.assemble), hold it to transformers (agent.recipe.native.selfcheck, in a stand-in
subprocess) on the checkpoint's config in float32 and in the run dtype, and on the family's other settings
the file reads from the config (another rope type, biases, tied embeddings, the MoE layout: `checked_variants`);
any step that fails keeps the adapter, with the layer kind and the reason."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.safe_load import loads_json
from agent.recipe.native.assemble import CODE_DIR, write
from agent.recipe.native.compose import derive
from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts import Composition
from agent.recipe.native.parts.mtp import without_unshipped_mtp

SELFCHECK_TIMEOUT_S = 600      # the least a self-check is given
SELFCHECK_JOB_S = 120          # and this per job: a family of many settings is more work, not a hang
_decisions: dict[str, "NativeDecision"] = {}


@dataclass(frozen=True)
class NativeDecision:
    native: bool
    features: Composition | None = None   # the parts chosen for the architecture
    kind: str | None = None          # the layer kind that fell back
    reason: str | None = None
    max_rel: float | None = None     # the self-check's largest logit difference (float32), relative
    source: str | None = None        # the native file's text, as the self-check ran it: what the recipe gets
    # (label, transformers' error) of the family settings transformers' own model cannot run: not checkable, so not
    # verified, and no failure of the file (`unchecked`)
    unverified: tuple[tuple[str, str], ...] = ()
    # what a passing job took as given (selfcheck's "note": the bfloat16 job's MoE routing ties), "label: note"
    notes: tuple[str, ...] = ()

    def summary(self) -> dict:
        """What the report and README say."""
        if self.native:
            # quant_config: every linear and the MoE grouped matmul take the checkpoint's (module.quantization)
            unverified = {label for label, _ in self.unverified}
            return {"native": True, "quant_config": True, "selfcheck_max_rel": self.max_rel,
                    "parts": dict(self.features.parts),
                    "serves": [label for label, _ in self.features.checked_variants if label not in unverified],
                    "fused": list(self.features.fused), "not_fused": list(self.features.unfused),
                    **({"not_verified": [not_checkable(label, error) for label, error in self.unverified]}
                       if self.unverified else {}),
                    **({"selfcheck_notes": list(self.notes)} if self.notes else {})}
        return {"native": False, "fell_back": self.kind, "reason": self.reason}


def render_native(ctx: dict, features: Composition) -> str:
    return write(features, ctx)


def selfcheck_timeout(jobs: list) -> float:
    """Seconds the self-check of `jobs` may take: SELFCHECK_JOB_S a job, at least SELFCHECK_TIMEOUT_S."""
    return max(SELFCHECK_TIMEOUT_S, SELFCHECK_JOB_S * len(jobs))


def selfcheck(jobs: list[dict], checkout: Path, timeout: float | None = None) -> list[dict]:
    """Run agent.recipe.native.selfcheck on `jobs` ({"config", "file", "class_name"}, optional "changes", "dtype")
    under the stand-in, the checkout's module/ and executor/ importable, within `timeout` seconds (by default
    selfcheck_timeout(jobs))."""
    from agent.child_failure import child_failure
    from agent.processes import owned_temp, run_tree
    from npu_standin.environment import standin_env

    project = Path(__file__).resolve().parents[3]
    timeout = selfcheck_timeout(jobs) if timeout is None else timeout
    # one process tree the migrator owns (stopped with it on SIGINT / SIGTERM or the timeout); its folder
    # is one the next command removes if a SIGKILL leaves it
    with owned_temp("selfcheck") as tmp, \
            tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job_file = Path(tmp) / "jobs.json"
        job_file.write_text(json.dumps(jobs))
        env = standin_env("cpu")
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(project), env.get("PYTHONPATH", "")])
        tree = run_tree([sys.executable, "-m", "agent.recipe.native.selfcheck", str(job_file)], cwd=Path(tmp),
                        env=env, stdout=out, stderr=err, timeout=timeout)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    line = next((l for l in stdout.splitlines() if l.startswith("SELFCHECK ")), None)
    if line is None:
        why = child_failure(stderr, tree.returncode, timed_out=tree.timed_out, timeout_s=timeout, stdout=stdout,
                            no_answer="it printed no SELFCHECK line")
        return [{"ok": False, "max_rel": None, "reason": f"self-check did not run: {why}"}] * len(jobs)
    return loads_json(line[len("SELFCHECK "):], "the self-check's answer")


def selfcheck_jobs(config: dict, variants, file: str, class_name: str) -> list[tuple[str, dict]]:
    """(label, job): the checkpoint's config in float32 and in the run dtype, then each of the family's settings
    the file reads from the config (`variants`: a composition's checked_variants, (label, changes)), in float32."""
    from agent.recipe.native.selfcheck import RUN_DTYPE

    base = {"config": config, "file": file, "class_name": class_name}
    jobs = [("the checkpoint's config", {**base, "dtype": "float32"}),
            (f"the checkpoint's config in {RUN_DTYPE}", {**base, "dtype": RUN_DTYPE})]
    return jobs + [(label, {**base, "changes": changes, "dtype": "float32"}) for label, changes in variants]


def not_checkable(label: str, error: str) -> str:
    return f"not checkable: transformers cannot run {label} ({error})"


def _uncheckable_setting(job: dict, result: dict) -> bool:
    """A family setting's job (not the checkpoint's own config) on which transformers' own model raised (the
    self-check's ReferenceFailed): no checkpoint of that setting runs in transformers, so none is published."""
    return not result["ok"] and result.get("checkable") is False and bool(job.get("changes"))


def verdict(labelled: list[tuple[str, dict]], results: list[dict]) -> tuple[bool, float | None, str | None]:
    """A migration's decision on its self-check jobs: native when every job passes (max_rel: the checkpoint's
    float32 job's), else the first failing job's label and reason. A family setting transformers itself cannot run
    is no failure (`unchecked` names it); the checkpoint's own config it cannot run is one (nothing was verified)."""
    for (label, job), result in zip(labelled, results):
        if _uncheckable_setting(job, result):
            continue
        if not result["ok"]:
            why = not_checkable("it", result["reason"]) if result.get("checkable") is False else result["reason"]
            return False, result["max_rel"], f"{label}: {why}"
    return True, results[0]["max_rel"], None


def unchecked(labelled: list[tuple[str, dict]], results: list[dict]) -> list[tuple[str, str]]:
    """(label, transformers' error) of each family setting the self-check could not hold the file to."""
    return [(label, result["reason"]) for (label, job), result in zip(labelled, results)
            if _uncheckable_setting(job, result)]


def notes(labelled: list[tuple[str, dict]], results: list[dict]) -> list[str]:
    """`label: note` of each passing job whose self-check took something as given (its routing ties)."""
    return [f"{label}: {result['note']}" for (label, _), result in zip(labelled, results)
            if result.get("ok") and result.get("note")]


def checked(ctx: dict, config: dict, composition: Composition, checkout: Path) -> NativeDecision:
    """The native file of `composition` held to transformers on `config`'s shrunk copy and its variants."""
    from agent.processes import owned_temp

    source = render_native(ctx, composition)
    with owned_temp("native_model") as tmp:
        path = Path(tmp) / f"modeling_{ctx['model_name']}.py"
        path.write_text(source)
        labelled = selfcheck_jobs(config, composition.checked_variants, str(path), ctx["framework_class"])
        results = selfcheck([job for _, job in labelled], checkout)
    ok, max_rel, why = verdict(labelled, results)
    if not ok:
        return NativeDecision(False, composition, "self-check", why)
    return NativeDecision(True, composition, max_rel=max_rel, source=source,
                          unverified=tuple(unchecked(labelled, results)), notes=tuple(notes(labelled, results)))


def _generator_hash() -> str:
    """The code files' text: a decision is remembered for one version of the generator."""
    digest = hashlib.sha256()
    for path in sorted(CODE_DIR.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def type_note(model_type: str, config: dict | None = None) -> str:
    """Whether the native generator writes `model_type` (a causal-LM type of the installed transformers), in a
    few words for a one-line answer: derived on the checkpoint's own `config` (its text decoder's, a dict with
    model_type) where one is given, else on the type's default config (the self-check that follows in a
    migration is not run here), or the layer kind that would fall back to the adapter and why. A type's defaults
    are often no published checkpoint (deepseek_v2's routing, dots1's, ministral's rope): the checkpoint's config
    is the answer for that checkpoint."""
    from transformers import AutoConfig

    try:
        derive({**config, "model_type": model_type} if config is not None else AutoConfig.for_model(model_type).to_dict())
    except NotNative as exc:
        return f"a type the native generator does not write ({exc.kind}: {' '.join(exc.reason.split())[:160]})"
    except Exception as exc:  # noqa: BLE001 - transformers' own code failed under a probe: not recognised
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return f"a type the native generator does not write (its probe failed: {text})"
    return "a type the native generator writes"


def decide(ctx: dict, config: dict, checkout: Path | None) -> NativeDecision:
    """Native or not for the architecture of `config` (a checkpoint's config.json), once per
    configuration and generator in this process."""
    from agent.provenance import REMOTE_PACKAGE

    config = without_unshipped_mtp(config, ctx.get("model_path"))       # an MTP draft only where its tensors are
    key = hashlib.sha256(json.dumps([config, ctx.get("model_name"), ctx.get("framework_class"), str(checkout),
                                     _generator_hash()], sort_keys=True, default=str).encode()).hexdigest()
    if key in _decisions:
        return _decisions[key]
    if str(ctx.get("modeling_module") or "").startswith(REMOTE_PACKAGE + "."):
        decision = NativeDecision(False, kind="model", reason="remote code (trust_remote_code): only transformers' "
                                                              "own architectures are written natively")
    elif checkout is None:
        decision = NativeDecision(False, kind="model", reason="no cann-recipes-infer checkout to check the native file in")
    else:
        try:
            composition = derive(config)
        except NotNative as exc:
            composition, decision = None, NativeDecision(False, kind=exc.kind, reason=exc.reason)
        except Exception as exc:  # noqa: BLE001 - transformers' own code failed under a probe: not recognised
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            composition, decision = None, NativeDecision(False, kind="model", reason=f"the architecture's probe failed ({text})")
        if composition is not None:
            decision = checked(ctx, config, composition, checkout)
    _decisions[key] = decision
    return decision
