"""An image-text checkpoint served by its text decoder, as upstream serves Qwen3.5 and Gemma 4 ("text-side
inference": the language decoder only; the vision encoder is not covered). The one place every image-text
checkpoint is classified: `text_decoder(config)` reads, from transformers' own image-text class built on the
checkpoint's config (on the meta device: no weight is allocated),

- the decoder's config as a causal-LM type's config.json (`config`): the config's text part, its model_type a
  causal-LM type of transformers; a decoder written only inside its image-text model (Qwen2-VL / 2.5-VL / 3-VL:
  `TEXT_ONLY_TYPES`) as the causal-LM type whose arithmetic it is on text, its M-RoPE reduced to the 1-D rope a
  text-only prompt gives (each of the temporal / height / width sections rotates by the token's position: the
  three position rows are equal when no image is in the prompt);
- where the decoder's tensors are in the checkpoint (`renames`: the image-text class's own conversion mapping,
  then its decoder's prefix to `model.` and its head to `lm_head`);
- what is not served (`skipped`: the vision tower, the projector; the loader skips their tensors by name).

What the checkpoint serves is then held, per step, to transformers' image-text model on text-only prompts
(agent.recipe.native.selfcheck)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

# Text decoders transformers writes only inside their image-text model, and the causal-LM type whose arithmetic
# they are on a text-only prompt, once the M-RoPE is reduced (the self-check against the image-text model holds
# each pairing: a wrong one fails it).
TEXT_ONLY_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                   "qwen3_vl_moe_text": "qwen3_moe"}
# What such a decoder's code fixes where its causal-LM type reads a config key (its config has no such key): the
# value the causal-LM type's key must take to compute as it does. Qwen3VLMoeTextTopKRouter always divides the
# top-k weights by their sum (qwen3_moe: norm_topk_prob True).
FIXED_IN_CODE = {"qwen3_vl_moe_text": {"norm_topk_prob": True}}
# rope keys of an M-RoPE that a text-only prompt makes a 1-D rope
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
DROPPED = ("auto_map", "quantization_config", "architectures", "transformers_version")


@dataclass(frozen=True)
class TextDecoder:
    """The text decoder of an image-text checkpoint (see the module's docstring)."""
    image_text_type: str            # the checkpoint's model_type (llava, gemma3, qwen2_5_vl, ...)
    image_text_class: str           # transformers' image-text class (LlavaForConditionalGeneration)
    config: dict                    # the decoder's config.json, as a causal-LM type's
    own_config: dict                # the decoder's config as the image-text checkpoint has it (its own type)
    text_type: str                  # the decoder's own model_type in the checkpoint (qwen2_5_vl_text)
    decoder_prefix: str             # where the decoder sits in the image-text model (model.language_model)
    head: str                       # the head's name in the image-text model (lm_head)
    renames: tuple                  # (regex, replacement): the checkpoint's names -> the causal-LM's
    skipped: tuple                  # the image-text model's modules not served (model.vision_tower, ...)
    reduced: str | None = None      # what of the rope a text-only prompt reduces, in words
    stored_renames: tuple = ()      # (regex, replacement): the checkpoint's names -> the image-text model's
    fixed_in_code: tuple = ()       # (key, value): keys `config` sets that the decoder's own config has not

    @property
    def causal_lm_type(self) -> str:
        return self.config["model_type"]

    def note(self) -> str:
        """One line for the report and the README."""
        return (f"served by its text decoder ({self.text_type} at {self.decoder_prefix}, "
                f"as {self.causal_lm_type}); not served: {', '.join(self.skipped) or 'nothing else'}"
                + (f"; {self.reduced}" if self.reduced else ""))


class NotServedByText(Exception):
    """An image-text checkpoint whose text decoder is not served (the one line says why)."""


def is_image_text(config: dict) -> bool:
    """An image-text checkpoint by its config: a vision_config, or a model_type transformers' image-text-to-text
    mapping names (chameleon's and idefics' configs have no vision_config of that name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not isinstance(config, dict):
        return False
    model_type = config.get("model_type")
    return isinstance(config.get("vision_config"), dict) or (isinstance(model_type, str) and
                                                             model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def text_decoder(config: dict) -> TextDecoder | None:
    """The text decoder of the image-text checkpoint `config` (its config.json), or None for a checkpoint that is
    not image-text. NotServedByText: image-text, but its decoder cannot be served (no transformers class, a text
    type with no causal-LM equivalent, a conversion the loader does not write)."""
    if not is_image_text(config):
        return None
    return _text_decoder(json.dumps(config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=32)
def _text_decoder(config_json: str) -> TextDecoder:
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    from engine.safe_load import loads_json

    config = loads_json(config_json, "the checkpoint's config")
    vl_type = config.get("model_type")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    class_name = next((a for a in architectures if hasattr(transformers, a)), None) or \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(vl_type)
    if not class_name or not hasattr(transformers, class_name):
        raise NotServedByText(f"transformers {transformers.__version__} has no image-text class for model_type "
                              f"{vl_type!r}")
    try:
        vl_config = AutoConfig.for_model(vl_type, **{k: v for k, v in config.items() if k not in DROPPED + ("model_type",)})
        text_config = vl_config.get_text_config(decoder=True)
        with torch.device("meta"):
            model = getattr(transformers, class_name)._from_config(vl_config)
    except Exception as exc:  # noqa: BLE001 - transformers' own code refuses the config or cannot build it here
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        raise NotServedByText(f"transformers cannot build {class_name} on its config ({text})") from exc
    if text_config is vl_config:
        raise NotServedByText(f"{class_name} has no separate text decoder config (no text_config)")
    names = {id(module): name for name, module in model.named_modules()}
    decoder, head = _decoder(model), model.get_output_embeddings()
    prefix, head_name = names.get(id(decoder)), names.get(id(head))
    if not prefix or head_name is None:
        raise NotServedByText(f"{class_name}: no text decoder and head transformers names (get_decoder / "
                              "get_output_embeddings)")
    text = {k: v for k, v in text_config.to_dict().items() if k not in DROPPED}
    text_type = text["model_type"]
    # tied as transformers ties the image-text model (its own rule: the text config's or the composite's key)
    text["tie_word_embeddings"] = head.weight is model.get_input_embeddings().weight
    own = dict(text)
    reduced = None
    if text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if text_type not in TEXT_ONLY_TYPES:
            raise NotServedByText(f"its text decoder {text_type} has no causal-LM class in transformers "
                                  f"{transformers.__version__} and no causal-LM type it equals on text")
        text["model_type"] = TEXT_ONLY_TYPES[text_type]
        text, reduced = reduce_mrope(text)
    fixed = tuple((key, value) for key, value in FIXED_IN_CODE.get(text_type, {}).items() if key not in own)
    text.update(fixed)
    # stored names -> the image-text model's (its conversion mapping), then its decoder and head -> a causal LM's
    served_names = [n for n, _ in model.named_parameters() if n.startswith((prefix + ".", head_name + "."))]
    renames = stored_name_renames(vl_type, served_names, type(model))
    stored = tuple(renames)
    base = getattr(decoder, "base_model_prefix", "") or "model"
    escaped = re.escape(prefix)
    if head_name != "lm_head":
        renames.append((f"^{re.escape(head_name)}\\.", "lm_head."))
    # a decoder stored whole as a causal LM (language_model.model.*, the image-text class's legacy layout) or
    # as its base model (model.language_model.*)
    renames += [(f"^{escaped}\\.{re.escape(base)}\\.", "model."), (f"^{escaped}\\.", "model.")]
    served = (prefix, head_name)
    skipped = tuple(name for name, _ in _tops(model) if not any(s == name or s.startswith(name + ".") or
                                                                name.startswith(s + ".") for s in served))
    return TextDecoder(image_text_type=vl_type, image_text_class=class_name, config=text, own_config=own,
                       text_type=text_type,
                       decoder_prefix=prefix, head=head_name, renames=tuple(renames), skipped=skipped, reduced=reduced,
                       stored_renames=stored, fixed_in_code=fixed)


def stored_name_renames(vl_type: str, served_names: list[str], model_class=None) -> list[tuple[str, str]]:
    """transformers' renames of the image-text type's stored tensor names (regex, replacement: the native loader's
    re.sub, captured groups too), in its order. A conversion other than a rename (a split, a merge) or a scoped
    rename is dropped where it produces none of `served_names` (the decoder's and the head's parameters: it converts
    the vision tower's tensors, which are skipped), else the decoder is not served. Where the mapping has none, the
    image-text class's own `_checkpoint_conversion_mapping` (transformers 5.0 keeps them there)."""
    from transformers import conversion_mapping

    renames = []
    for rule in conversion_mapping.get_checkpoint_conversion_mapping(vl_type) or []:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming" and not getattr(rule, "scope_prefix", None) and len(targets) == 1:
            target = targets[0].lstrip("^").replace("\\.", ".").rstrip("$")
            renames += [(source, target) for source in sources]
            continue
        if [_name(source) for source in sources] == [_name(target) for target in targets]:
            continue          # a conversion of the stored tensor that keeps its name (an alignment)
        if all("experts.*." in source for source in sources):
            continue          # the experts' merge: the sparse-MoE part loads the stored experts itself
        patterns = [re.compile(t.replace("\\1", ".*").replace("\\2", ".*")) for t in targets]
        if any(pattern.search(name) for pattern in patterns for name in served_names):
            raise NotServedByText(f"transformers converts the text decoder's tensors {sources} -> {targets} for "
                                  f"{vl_type} (not a rename): the native loader reads the checkpoint's names")
    if not renames:
        # transformers before the conversion mapping held them (5.0): the class's own regex -> replacement table
        mapping = getattr(model_class, "_checkpoint_conversion_mapping", None)
        if isinstance(mapping, dict):
            renames += [(source, target) for source, target in mapping.items()
                        if isinstance(source, str) and isinstance(target, str)]
    for pattern, _ in renames:
        re.compile(pattern)
    return renames


def _name(pattern: str) -> str:
    return pattern.strip("^$").replace("\\.", ".")


def _decoder(model):
    """The image-text model's text decoder: its base model's (model.language_model), as get_decoder finds it; a
    decoder that is a whole causal LM (llama4's language_model) gives its base model."""
    decoder = model.get_decoder()
    inner = getattr(decoder, "model", None)
    if inner is not None and decoder is not model and getattr(decoder, "get_output_embeddings", lambda: None)() is not None:
        return inner
    return decoder


def _tops(model):
    """The modules and own parameters (llava_next's image_newline) of the image-text model and of its base model
    (model.*)."""
    found = [(name, child) for name, child in [*model.named_children(), *model.named_parameters(recurse=False)]
             if name != "model"]
    base = getattr(model, "model", None)
    if base is not None:
        found += [(f"model.{name}", child) for name, child in [*base.named_children(),
                                                                 *base.named_parameters(recurse=False)]]
    return found


def reduce_mrope(text: dict) -> tuple[dict, str | None]:
    """`text` with its M-RoPE as the 1-D rope a text-only prompt gives (the same rope_theta, rope_type default):
    the three sections' positions are the token's position, so every frequency rotates by it."""
    text = dict(text)
    reduced = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and (set(MROPE_KEYS) & set(rope) or rope.get("rope_type") == "mrope"
                                       or rope.get("type") == "mrope"):
            section = rope.get("mrope_section")
            rope = {k: v for k, v in rope.items() if k not in MROPE_KEYS}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope["rope_type"] = "default"
                rope.pop("type", None)
            text[key] = rope
            reduced = (f"M-RoPE (mrope_section {section}) reduced to the 1-D rope of text positions: a text-only "
                       "prompt gives every section the token's position")
    return text, reduced


def apply_renames(renames, name: str) -> str:
    """A checkpoint tensor's name as the native loader renames it (its CHECKPOINT_RENAMES loop)."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name, count=1)
    return name


def image_text_model(decoder: TextDecoder, checkpoint_config: dict, text_config):
    """transformers' image-text model of the checkpoint on a small copy of its config: the text decoder's config
    `text_config` (a shrunk copy of `decoder.own_config`), a vision tower of tiny widths and one or two layers
    (random: a text-only prompt never reaches it), float32."""
    import torch
    import transformers
    from transformers import AutoConfig

    from agent.recipe.shrink import shrink_config

    rest = {k: v for k, v in checkpoint_config.items() if k not in DROPPED + ("model_type", "text_config")}
    key = next((k for k in ("text_config", "llm_config", "language_config") if k in checkpoint_config), "text_config")
    rest[key] = text_config.to_dict()
    vision = rest.get("vision_config")
    tried = []
    if isinstance(vision, dict):
        tried.append({**rest, "vision_config": {**vision, **shrink_config(vision)}})
    tried.append(rest)
    last = None
    for kwargs in tried:
        try:
            config = AutoConfig.for_model(decoder.image_text_type, **kwargs)
            config._attn_implementation = "eager"
            config.get_text_config(decoder=True)._attn_implementation = "eager"
            return getattr(transformers, decoder.image_text_class)._from_config(config, dtype=torch.float32).eval()
        except Exception as exc:  # noqa: BLE001 - a vision config its class refuses shrunk: the next try
            last = exc
    raise last


def transformers_auto_class(checkpoint):
    """The auto class that loads the checkpoint at `checkpoint` as transformers runs it, the oracle of every
    verdict (auto_class_for its config.json)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from engine.safe_load import load_json

    try:
        config = load_json(Path(checkpoint) / "config.json")
    except (OSError, ValueError):
        return AutoModelForCausalLM
    return auto_class_for(config)


def auto_class_for(config: dict):
    """The auto class that builds a checkpoint of `config` (its config.json) as transformers runs it — the one
    place every build of a checkpoint's transformers model asks: the image-text class for an image-text checkpoint
    whose type has no causal-LM class (its text-only prompts then run the whole image-text model), else
    AutoModelForCausalLM (gemma3's maps to its image-text class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(config, dict) and is_image_text(config) and \
            config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.get("auto_map"):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
