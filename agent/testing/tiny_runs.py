"""Whether transformers itself runs a type on a tiny config: the tiny configs tried, in order, and the first
checkpoint of them transformers loads, runs and generates with.

A type transformers runs on none of them has no oracle here: `scripts/try_architectures.py` reports it as
`hf-fails` and `scripts/native_coverage.py` does not count it as testable.
"""

from __future__ import annotations

from pathlib import Path

MAX_PARAMS = 30_000_000   # a tiny config larger than this is not built (see build_tiny_checkpoint)
# Tiny configs tried in order until transformers itself runs one: hybrids with 2 layers may have no
# attention layer at all, and some configs need more layers than their pattern's length.
LAYER_TRIES = (2, 4, 8, "default")
# Hints for the retries, used only where the config class knows the key: hybrids that name their
# attention layers explicitly get one (bamba's default has none at all).
RETRY_HINTS = {"attn_layer_indices": [1]}


def tries(model_type: str) -> list[tuple[str, dict]]:
    """(label, overrides) per tiny config: 2 layers; then 4, 8 and the type's own layer count,
    with the retry hints its config knows."""
    from transformers import AutoConfig

    from agent.testing.tiny_checkpoint import scaled_default_overrides

    out = [("2 layers", {})]
    try:
        base = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - its defaults do not validate; the tiny dims may
        return out
    known = set(base.to_dict())
    hints = {k: v for k, v in RETRY_HINTS.items() if k in known}
    for layers in LAYER_TRIES[1:]:
        count = getattr(base, "num_hidden_layers", None) if layers == "default" else layers
        if isinstance(count, int) and count not in (2, 4, 8) or layers != "default":
            out.append((f"{count} layers", {"num_hidden_layers": count, **hints}))
    scaled = scaled_default_overrides(model_type)
    if scaled:
        out.append(("own defaults scaled down", {**scaled, "tiny_dims": False}))
    return out


def transformers_runs(ckpt: Path) -> str | None:
    """None when transformers loads the checkpoint, runs a forward and generates; else its error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(ckpt)(["An attention function can be described"], return_tensors="pt")
        with torch.inference_mode():
            model(**ids)
            model.generate(**ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None)
    except Exception as exc:  # transformers' own failure on this config
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    return None


def tiny_checkpoints(model_type: str, out: Path, errors: list[str]):
    """(label, overrides, checkpoint) for each tiny config of `tries` that builds, in order; a config the config
    class or the model's __init__ refuses is appended to `errors` and skipped."""
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    for layers, overrides in tries(model_type):
        try:
            ckpt = build_tiny_checkpoint(model_type, out / f"ckpt_{layers.split()[0]}", max_params=MAX_PARAMS,
                                         **overrides)
        except Exception as exc:  # the config class or the model's __init__ refuses these dims
            errors.append(f"{layers}: building: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
            continue
        yield layers, overrides, ckpt


def checkpoint_for(model_type: str, out: Path) -> tuple[Path | None, str | None, dict]:
    """The first tiny checkpoint transformers itself runs, else (None, its errors)."""
    errors: list[str] = []
    for layers, overrides, ckpt in tiny_checkpoints(model_type, out, errors):
        error = transformers_runs(ckpt)
        if error is None:
            return ckpt, None, overrides
        errors.append(f"{layers}: {error}")
    return None, " | ".join(errors), {}
