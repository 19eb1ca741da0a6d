"""Native or adapter: derive the architecture's features, write the native file, hold it to
transformers (agent.recipe.native.selfcheck, in a stand-in subprocess); any step that fails keeps the
adapter, with the layer kind and the reason."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.safe_load import loads_json
from agent.recipe.native.features import NativeFeatures, NotNative, derive

TEMPLATE = "framework/native/modeling.py.j2"
SELFCHECK_TIMEOUT_S = 600
_decisions: dict[str, "NativeDecision"] = {}


@dataclass(frozen=True)
class NativeDecision:
    native: bool
    features: NativeFeatures | None = None
    kind: str | None = None          # the layer kind that fell back
    reason: str | None = None
    max_rel: float | None = None     # the self-check's largest logit difference, relative

    def summary(self) -> dict:
        """What the report and README say."""
        if self.native:
            return {"native": True, "selfcheck_max_rel": self.max_rel, "fused": list(self.features.fused),
                    "not_fused": list(self.features.unfused)}
        return {"native": False, "fell_back": self.kind, "reason": self.reason}


def class_prefix(framework_class: str) -> str:
    return framework_class.removesuffix("ForCausalLM") or framework_class


def native_context(ctx: dict, features: NativeFeatures) -> dict:
    """What the native template reads beyond the framework target's context."""
    return {"native": features, "class_prefix": class_prefix(ctx["framework_class"]),
            "qkv_name": "qkv_proj" if features.fused_qkv else "merged_qkv_proj",
            "native_source_header": native_header(ctx)}


def native_header(ctx: dict) -> str:
    from agent.migrate import provenance

    what = (f"{ctx['model_name']}: {ctx.get('architecture') or ctx['model_name']} for cann-recipes-infer's executor, "
            "written by infer-migrator's native generator from the transformers code below")
    if not ctx.get("modeling_module"):
        return f"# coding=utf-8\n# {what}\n"
    prov = provenance.of_vendored_model(str(ctx["modeling_module"]), ctx.get("transformers_version"),
                                        ctx.get("model_source"), ctx.get("model_path"))
    return provenance.header_text(prov, what)


def render_native(ctx: dict, features: NativeFeatures) -> str:
    from agent.recipe.templating import environment

    return environment().get_template(TEMPLATE).render(**{**ctx, **native_context(ctx, features)})


def selfcheck(jobs: list[dict], checkout: Path, timeout: float = SELFCHECK_TIMEOUT_S) -> list[dict]:
    """Run agent.recipe.native.selfcheck on `jobs` ({"config", "file", "class_name"}) under the stand-in,
    the checkout's module/ and executor/ importable."""
    from agent.child_failure import child_failure
    from agent.processes import owned_temp, run_tree
    from npu_standin.environment import standin_env

    project = Path(__file__).resolve().parents[3]
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


def checked(ctx: dict, config: dict, features: NativeFeatures, checkout: Path) -> NativeDecision:
    """The native file of `features` held to transformers on `config`'s shrunk copy."""
    from agent.processes import owned_temp

    with owned_temp("native_model") as tmp:
        path = Path(tmp) / f"modeling_{ctx['model_name']}.py"
        path.write_text(render_native(ctx, features))
        result = selfcheck([{"config": config, "file": str(path), "class_name": ctx["framework_class"]}], checkout)[0]
    if not result["ok"]:
        return NativeDecision(False, features, "self-check", result["reason"])
    return NativeDecision(True, features, max_rel=result["max_rel"])


def type_note(model_type: str) -> str:
    """Whether the native generator writes `model_type` (a causal-LM type of the installed transformers), in a
    few words for a one-line answer: derived on the type's default config, as scripts/native_coverage.py surveys
    it (the self-check that follows in a migration is not run here), or the layer kind that would fall back to
    the adapter and why."""
    from transformers import AutoConfig

    try:
        derive(AutoConfig.for_model(model_type).to_dict())
    except NotNative as exc:
        return f"a type the native generator does not write ({exc.kind}: {' '.join(exc.reason.split())[:160]})"
    except Exception as exc:  # noqa: BLE001 - transformers' own code failed under a probe: not recognised
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return f"a type the native generator does not write (its probe failed: {text})"
    return "a type the native generator writes"


def decide(ctx: dict, config: dict, checkout: Path | None) -> NativeDecision:
    """Native or not for the architecture of `config` (a checkpoint's config.json), once per
    configuration and generator in this process."""
    from agent.migrate.provenance import REMOTE_PACKAGE
    from agent.paths import templates_dir

    key = hashlib.sha256(json.dumps([config, ctx.get("model_name"), ctx.get("framework_class"), str(checkout),
                                     (templates_dir() / TEMPLATE).read_text()], sort_keys=True, default=str)
                         .encode()).hexdigest()
    if key in _decisions:
        return _decisions[key]
    if str(ctx.get("modeling_module") or "").startswith(REMOTE_PACKAGE + "."):
        decision = NativeDecision(False, kind="model", reason="remote code (trust_remote_code): only transformers' "
                                                              "own architectures are written natively")
    elif checkout is None:
        decision = NativeDecision(False, kind="model", reason="no cann-recipes-infer checkout to check the native file in")
    else:
        try:
            features = derive(config)
        except NotNative as exc:
            features, decision = None, NativeDecision(False, kind=exc.kind, reason=exc.reason)
        except Exception as exc:  # noqa: BLE001 - transformers' own code failed under a probe: not recognised
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            features, decision = None, NativeDecision(False, kind="model", reason=f"the architecture's probe failed ({text})")
        if features is not None:
            decision = checked(ctx, config, features, checkout)
    _decisions[key] = decision
    return decision
