"""The Probe: one architecture's transformers model, built on a shrunk copy of a checkpoint's config (tiny
widths and vocabulary, the first layers that hold every layer kind, random weights, fp32, eager),
that the parts read: its modeling module, its layers, its config; and copies of it with config keys changed
(`variant`), to see what a key controls. Shared readings: `children`, `probe_norm`."""

from __future__ import annotations

import copy
import importlib

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention_head_dim import WRITTEN_PER_LAYER, layer_head_dims, per_layer_ints

# dims the NPU kernels constrain (head widths, rope and latent widths): kept at the checkpoint's values, so that
# a checkpoint the kernels cannot serve fails the self-check, not the trial
PROBE_VOCAB = 512
DROP = "<drop>"         # a Probe.variant change that removes the key (transformers' default then applies)
KERNEL_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")
SIZE_KEYS = {"hidden_size", "num_hidden_layers", "vocab_size"}
# widths a config keeps equal to hidden_size where the checkpoint does (shrunk with it)
WIDTHS_OF_HIDDEN = ("word_embed_proj_dim",)
# widths a config keeps a multiple of hidden_size (shrunk with it)
MULTIPLES_OF_HIDDEN = ("attention_hidden_size",)


def first_line(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _field_takes_none(model_type: str, key: str) -> bool:
    """Whether the config class of `model_type` accepts None for `key` (transformers 5's strict dataclass
    configs type some ids as plain int: modernbert-decoder's pad_token_id)."""
    import typing

    from transformers import CONFIG_MAPPING

    field = getattr(CONFIG_MAPPING[model_type], "__dataclass_fields__", {}).get(key)
    if field is None:
        return True
    kind = field.type
    if isinstance(kind, str):
        return "None" in kind or "Optional" in kind or kind == "Any"
    return kind is typing.Any or kind is type(None) or type(None) in typing.get_args(kind)


def shrunk_config(config_dict: dict, changes: dict | None = None):
    """The transformers config of `config_dict` with tiny widths, a small vocabulary and the first layers that
    hold every layer kind (agent.recipe.shrink) but the kernels' head / rope / latent dims, in fp32, eager
    attention, a small sliding window (when the architecture has one) so that a short sequence crosses it, and
    a query_pre_attn_scalar unequal to head_dim so that the two scales differ. `changes`: config keys set (DROP:
    removed) after the shrink, before the window is made small (a variant the file must also serve)."""
    from transformers import AutoConfig

    from agent.recipe.shrink import shrink_config, ssm_heads

    data = {k: v for k, v in config_dict.items() if k not in ("auto_map", "quantization_config", "architectures")}
    if not SIZE_KEYS <= set(data):
        # a partial config (an image-text checkpoint's text part may name its model_type alone): the sizes as
        # transformers reads them, so that they shrink (not the type's full-size defaults built in float32)
        known = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
        data = {**known.to_dict(), **data}
        if "n_embd" not in data:
            # sizes stored under the config class's own names (mpt's d_model, n_heads, n_layers): read under
            # transformers' (its attribute_map), so that they shrink
            for name, stored in getattr(type(known), "attribute_map", {}).items():
                if name in SIZE_KEYS | {"num_attention_heads"} and stored in data and name not in data:
                    data[name] = data.pop(stored)
    overrides = shrink_config(data)
    real = {key: data[key] for key in KERNEL_DIMS if isinstance(data.get(key), int)}
    heads, hidden = data.get("num_attention_heads"), data.get("hidden_size")
    if "kv_lora_rank" in data:
        if "qk_head_dim" in data and {"qk_nope_head_dim", "qk_rope_head_dim"} <= set(real):
            real["qk_head_dim"] = real["qk_nope_head_dim"] + real["qk_rope_head_dim"]
    elif "head_dim" not in real and isinstance(heads, int) and isinstance(hidden, int) and heads:
        # a head width the config derives (hidden_size // heads): the shrunk width keeps it
        real["hidden_size"] = overrides.get("num_attention_heads", heads) * (hidden // heads)
    overrides.update(real)
    for key in WIDTHS_OF_HIDDEN:
        if data.get(key) == hidden and "hidden_size" in overrides:
            overrides[key] = overrides["hidden_size"]        # opt's embedding width: the hidden width unless projected
    for key in MULTIPLES_OF_HIDDEN:
        value = data.get(key)
        if isinstance(value, int) and isinstance(hidden, int) and hidden and value % hidden == 0 \
                and "hidden_size" in overrides:
            overrides[key] = value // hidden * overrides["hidden_size"]     # zamba2's attention width: 2 x hidden
    overrides.update(ssm_heads({**data, **overrides}, overrides.get("hidden_size")))   # after the kept widths
    data.update(overrides)
    # random token ids need no tokenizer: a small vocabulary, the special ids inside it
    if isinstance(data.get("vocab_size"), int) and data["vocab_size"] > PROBE_VOCAB:
        data["vocab_size"] = PROBE_VOCAB
        for key in [k for k, v in data.items() if k.endswith("_token_id") and isinstance(v, int) and v >= PROBE_VOCAB]:
            # no padding row outside the vocabulary; an id the config types as int stays an int
            none_ok = key == "pad_token_id" and _field_takes_none(data["model_type"], key)
            data[key] = None if none_ok else PROBE_VOCAB - 1
    layers = data.get("num_hidden_layers")
    data = apply_changes(data, {key: value[:layers] if isinstance(value, list) and isinstance(layers, int)
                                and len(value) == config_dict.get("num_hidden_layers") else value
                                for key, value in stored_names(data["model_type"], changes or {}).items()})
    if isinstance(data.get("sliding_window"), int) and data["sliding_window"]:
        data["sliding_window"] = 5
    if isinstance(data.get("sliding_window"), int) and isinstance(data.get("local_attention"), int):
        data["local_attention"] = 10    # modernbert-decoder's: its config sets sliding_window to half of it
    if isinstance(data.get("attention_layers"), list) and isinstance(data.get("window_size"), int):
        data["window_size"] = 5         # gpt_neo's local layers' window
    if isinstance(data.get("query_pre_attn_scalar"), (int, float)):
        data["query_pre_attn_scalar"] = 24
    model_type = data.pop("model_type")
    data.pop("transformers_version", None)
    data["torch_dtype"] = "float32"
    data["dtype"] = "float32"
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = "eager"
    width = global_value(config, "num_attention_heads"), global_value(config, "head_dim")
    if isinstance(heads, int) and isinstance(hidden, int) and isinstance(real.get("head_dim"), int) \
            and hidden == heads * real["head_dim"] and all(isinstance(w, int) for w in width) \
            and config.hidden_size != width[0] * width[1] and not _runs(config):
        # the checkpoint's hidden_size is its heads' width and the architecture's code ties them (helium's,
        # stablelm's o_proj: hidden_size -> hidden_size): the shrunk hidden_size is the shrunk heads' width
        config = AutoConfig.for_model(model_type, **{**data, "hidden_size": width[0] * width[1]})
        config._attn_implementation = "eager"
    return config


_RUNS: dict = {}


def _runs(config) -> bool:
    """Whether transformers' model of `config` builds and runs a forward pass (memoised by the config)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = config.to_json_string()
    if key not in _RUNS:
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            with torch.no_grad():
                model(input_ids=torch.tensor([[3, 5, 7]]), use_cache=False)
            _RUNS[key] = True
        except Exception:  # noqa: BLE001 - any failure: the shrunk widths do not make a model that runs
            _RUNS[key] = False
    return _RUNS[key]


def global_value(config, key: str):
    """config.`key`, or None where the config has no such key — or sets it per layer (transformers' heterogeneous
    configs refuse a global read of it)."""
    try:
        return getattr(config, key, None)
    except RuntimeError:    # transformers' AmbiguousGlobalPerLayerAttributeError (gemma4's per-layer head_dim)
        return None


def varying_per_layer(config) -> dict[str, list]:
    """The attributes a heterogeneous config (transformers' per_layer_config) sets per layer, each with its values
    across the layers in layer order, first seen first — those that differ between layers, or, where none
    differs, every per-layer one (transformers refuses a global read of them all the same). {} for a config
    that sets nothing per layer (and for transformers without heterogeneous configs)."""
    try:
        names = sorted(getattr(config, "per_layer_attributes", None) or ())
    except RuntimeError:
        names = []
    if not names:
        return {}
    values: dict[str, list] = {}
    for name in names:
        seen: list = []
        for layer in range(config.num_hidden_layers):
            value = getattr(config.per_layer_config[layer], name, None)
            if value not in seen:
                seen.append(value)
        values[name] = seen
    varying = {name: seen for name, seen in values.items() if len(seen) > 1}
    return varying or values


# what a heterogeneous config may set per layer for parts/mla_layer_shapes.py: an MLA layer's widths and heads
MLA_LAYER_KEYS = frozenset({"kv_lora_rank", "q_lora_rank", "num_attention_heads", "num_key_value_heads",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim"})


def per_layer_names(config) -> set[str]:
    """The attributes `config` sets per layer (transformers' per_layer_attributes); empty for a homogeneous one."""
    try:
        return set(getattr(config, "per_layer_attributes", None) or ())
    except RuntimeError:
        return set()


def sets_mla_shapes_per_layer(config) -> bool:
    """Whether what `config` sets per layer is MLA's widths alone (kv_lora_rank among them): this part's to read."""
    names = per_layer_names(config)
    return "kv_lora_rank" in names and names <= MLA_LAYER_KEYS


def layer_config(config, index: int):
    """Layer `index`'s view of `config` (its per-layer attributes resolved), or `config` where nothing is per layer."""
    return config.per_layer_config[index] if per_layer_names(config) else config


def per_layer_refusal(config) -> str | None:
    """One line naming what `config` sets per layer, or None where it sets nothing per layer but what a part writes
    layer by layer (the head width: parts/attention_head_dim.py): no part writes layers whose other attention
    shapes differ (the generated file reads each other width once, from the global config)."""
    varying = varying_per_layer(config)
    if not varying or set(varying) <= set(WRITTEN_PER_LAYER):
        return None
    varying = {name: seen for name, seen in varying.items() if name not in WRITTEN_PER_LAYER}   # named: the others
    shown = [f"{name} {'/'.join(str(value) for value in seen)}" for name, seen in list(varying.items())[:3]]
    more = f" (and {', '.join(list(varying)[3:])})" if len(varying) > 3 else ""
    return (f"{config.model_type} sets {', '.join(shown)}{more} per layer (per_layer_config): no part writes "
            "layers of unequal attention shapes")


def children(module) -> dict:
    """A module's children, dropouts left out (identities at inference), under the skeleton's names where the
    architecture's layout names them otherwise (agent.recipe.native.parts.layout)."""
    import torch

    shown = module.__dict__.get("_native_children")
    if shown is not None:
        return dict(shown)
    return {name: child for name, child in module.named_children() if not isinstance(child, torch.nn.Dropout)}


def refuse_composite_norm(norm) -> None:
    """NotNative for a "norm" with no weight of its own that holds modules (axk2's AXK2GatedRMSNorm: an RMSNorm
    times a sigmoid gate MLP of its output): what it computes is more than a norm."""
    held = sorted(children(norm))
    if getattr(norm, "weight", None) is None and held:
        raise NotNative("norm", f"{type(norm).__name__} holds modules {held} and no weight of its own (a norm with a "
                                "gate or another transform): not a norm the file writes")


def probe_norm(norm, width: int) -> float:
    """0 for y = w * x / rms(x), 1 for y = (1 + w) * x / rms(x); anything else is not an RMSNorm."""
    import torch

    refuse_composite_norm(norm)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    weight = getattr(norm, "weight", None)
    if weight is None or tuple(weight.shape) != (width,):
        raise NotNative("norm", f"{type(norm).__name__} has no weight of width {width}")
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = torch.randn(width, generator=torch.Generator().manual_seed(2))
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.copy_(w)
            y = norm(x)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    for offset in (0.0, 1.0):
        if torch.allclose(y, rms * (offset + w), rtol=1e-4, atol=1e-5):
            return offset
    raise NotNative("norm", f"{type(norm).__name__} is neither x*w nor x*(1+w) over the RMS")


def multi_query(config) -> bool:
    """Whether the config gives its key/value heads as falcon's do: num_kv_heads, and one where multi_query
    outside the new decoder architecture (its num_kv_heads then still the query heads)."""
    keys = config.to_dict()
    return "num_key_value_heads" not in keys and {"num_kv_heads", "multi_query", "new_decoder_architecture"} <= set(keys)


def key_value_heads(config) -> int | None:
    """The key/value heads the config gives (None: as many as the query heads)."""
    if multi_query(config):
        return 1 if config.multi_query and not config.new_decoder_architecture else config.num_kv_heads
    return getattr(config, "num_key_value_heads", None)


class Probe:
    """transformers' model of `config_dict`'s architecture on its shrunk config (see shrunk_config)."""

    def __init__(self, config_dict: dict, changes: dict | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.config_dict = dict(config_dict)
        self.changes = dict(changes or {})
        self._variants: dict = {}
        self._full = None
        self.memo: dict = {}          # readings the parts share (norm offsets, the dense attention's facts)
        try:
            self.config = shrunk_config(config_dict, self.changes)
        except Exception as exc:  # noqa: BLE001 - a config transformers refuses (its own validation)
            raise NotNative("model", f"transformers refuses the config ({first_line(exc)})") from exc
        # before any global read of a width (a heterogeneous config refuses those it sets per layer) and before
        # building a model no part could write (gemma4's per-layer input table alone is ~1.6 GB at probe size)
        refusal = per_layer_refusal(self.config)
        mla_per_layer = sets_mla_shapes_per_layer(self.config)      # MLA widths: parts/mla_layer_shapes.py's
        if (varying_per_layer(self.config) or config_dict.get("per_layer_config")) and not mla_per_layer:
            # read on the checkpoint's own layers too: the shrunk ones may agree where its do not (8 / 4 query heads
            # both shrink to 4, and transformers then drops the override), and a refusal names the checkpoint's values
            try:
                refusal = per_layer_refusal(self.full_config) or refusal
            except Exception:  # noqa: BLE001 - a checkpoint config transformers refuses unshrunk: the shrunk reading
                pass
        if refusal is not None and not mla_per_layer:
            raise NotNative("attention", refusal)
        torch.manual_seed(0)
        try:
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - a class transformers cannot build here
            raise NotNative("model", f"transformers cannot build it on a shrunk config ({first_line(exc)})") from exc
        self.model.eval()
        self.modeling = importlib.import_module(type(self.model).__module__)
        from agent.recipe.native.parts.layout import Layout, read_layout

        # a root under another name (gpt2's transformer.h.N): read under the skeleton's names
        try:
            self.layout = read_layout(self.model, self.config.hidden_size)
        except Exception as exc:  # noqa: BLE001 - a model the layout's reading cannot run: the model part says so
            self.layout = Layout(None, refusal=f"its modules' layout could not be read ({first_line(exc)})")
        self.base = self.layout.base if self.layout is not None else getattr(self.model, "model", None)
        self.layers = list(getattr(self.base, "layers", None) or [])
        config = self.config
        self.hidden = config.hidden_size
        self.heads = getattr(config, "num_attention_heads", None)
        if not isinstance(self.heads, int) and self.layout is not None and self.layout.one_mixer and self.layers \
                and all("linear_attn" in children(layer) for layer in self.layers):
            # Mamba2 layers alone (mamba2: a state-space model): no attention to read (parts/no_attention.py)
            self.kv_heads = self.head_dim = self.layer_head_dims = self.layer_kv_heads = None
            return
        if not isinstance(self.heads, int):
            raise NotNative("attention", f"{config.model_type} has no attention heads in its config: a recurrent or "
                                         "state-space model, which no part of the generator writes")
        # each layer's key/value heads where the config sets them per layer (gemma4's full layers: 2 beside 8;
        # parts/attention_heads.py's layer_key_heads); the probe's kv_heads is then the config's base count
        self.layer_kv_heads = per_layer_ints(config, "num_key_value_heads")
        if self.layer_kv_heads:
            config.allow_global_per_layer_attribute_access = True
        self.kv_heads = key_value_heads(config) or self.heads
        # each layer's head_dim where the config sets it per layer (gemma4: parts/attention_head_dim.py); the
        # probe's head_dim is then the first layer's, and the config's global read of it (which transformers
        # refuses on a heterogeneous config) its default: the attention part reads each layer's own
        self.layer_head_dims = layer_head_dims(config)
        if self.layer_head_dims:
            config.allow_global_per_layer_attribute_access = True
            self.head_dim = self.layer_head_dims[0]
            return
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def full_config(self):
        """The checkpoint's own config (not shrunk), as transformers reads it."""
        if self._full is None:
            from transformers import AutoConfig

            data = {k: v for k, v in self.config_dict.items() if k not in ("auto_map", "quantization_config",
                                                                           "architectures", "model_type",
                                                                           "transformers_version")}
            self._full = AutoConfig.for_model(self.config_dict["model_type"], **data)
        return self._full

    def variant(self, changes: dict) -> "Probe":
        """The probe of this checkpoint's config with `changes` applied to its shrunk copy (keys set; DROP removes
        one)."""
        key = repr(sorted(changes.items()))
        if key not in self._variants:
            self._variants[key] = Probe(self.config_dict, {**self.changes, **changes})
        return self._variants[key]


def stored_names(model_type: str, changes: dict) -> dict:
    """`changes` under both names of a key the config class aliases (attribute_map: bailing_hybrid's norm_topk_prob,
    stored as moe_renormalize; mpt's hidden_size, stored as d_model): a config dict may hold either, and which of two
    unequal values the class keeps differs by class, so a change under one name alone can be left unmade."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    aliases = getattr(known, "attribute_map", None) or {}
    other_name = {**{stored: alias for alias, stored in aliases.items()}, **aliases}
    both = {}
    for key, value in changes.items():
        both[key] = value
        if key in other_name:
            both[other_name[key]] = value
    return both


def apply_changes(config_dict: dict, changes: dict) -> dict:
    """`config_dict` with `changes` (DROP: the key removed)."""
    data = copy.deepcopy(config_dict)
    for key, value in changes.items():
        if value == DROP:
            data.pop(key, None)
        else:
            data[key] = copy.deepcopy(value)
    return data
