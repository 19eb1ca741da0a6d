"""The model under the native file's names: transformers' GPT-J / NeoX-era families name the same modules
otherwise (`gpt_neox.layers.N.attention.dense`, `transformer.h.N.attn.out_proj`, `model.final_layernorm`, an
MLP's `fc1` / `dense_h_to_4h`), and the parts read `model.layers.N.self_attn.o_proj`. `view(model)`: the model
seen under those names (a read-only proxy: attribute reads and calls reach the module itself, so a probe's
patched forward or forward hook acts on transformers' own layer), and the renames that take the checkpoint's
tensor names (save_pretrained's) to the file's, for its loader's CHECKPOINT_RENAMES. A model already under the
file's names gets no view and no renames."""

from __future__ import annotations

# transformers' names -> the file's, by where the module sits
ALIASES = {
    "top": {"gpt_neox": "model", "transformer": "model", "embed_out": "lm_head"},
    "model": {"embed_in": "embed_tokens", "wte": "embed_tokens", "word_embeddings": "embed_tokens", "h": "layers",
              "blocks": "layers", "final_layer_norm": "norm", "final_layernorm": "norm", "ln_f": "norm",
              "norm_f": "norm"},
    "layer": {"attention": "self_attn", "attn": "self_attn", "self_attention": "self_attn", "ln_1": "input_layernorm",
              "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm", "ffn": "mlp"},
    "attention": {"dense": "o_proj", "out_proj": "o_proj", "query_key_value": "qkv_proj", "q_layernorm": "q_norm",
                  "k_layernorm": "k_norm"},
    "mlp": {"dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj", "fc_in": "up_proj", "fc_out": "down_proj",
            "fc1": "up_proj", "fc2": "down_proj"},
}
# an MLP's activation (no tensor) takes the file's name where its linears were renamed
ACTIVATIONS = ("act", "activation_fn")
# the module that holds each level's children, as a checkpoint tensor's name begins (a regex group)
PREFIXES = {"top": "^", "model": "^(model)\\.", "layer": "^(model\\.layers\\.\\d+)\\.",
            "attention": "^(model\\.layers\\.\\d+\\.self_attn)\\.", "mlp": "^(model\\.layers\\.\\d+\\.mlp)\\."}
CHILD_LEVELS = {"top": {"model": "model"}, "model": {"layers": "layers"}, "layer": {"self_attn": "attention", "mlp": "mlp"}}


class View:
    """`module` under the file's names: `named_children` and attribute reads of a renamed child give the child
    (itself a View where its own children are renamed); everything else, calls and attribute writes included,
    is the module's."""

    def __init__(self, module, children: dict):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_children", children)

    @property
    def __class__(self):           # isinstance and the parts' messages see transformers' class
        return type(object.__getattribute__(self, "_module"))

    def named_children(self):
        return iter(self._children.items())

    def __getattr__(self, name):
        children = object.__getattribute__(self, "_children")
        if name in children:
            return children[name]
        return getattr(object.__getattribute__(self, "_module"), name)

    def __setattr__(self, name, value):
        setattr(self._module, name, value)

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)


def _renamed(module, level: str, renames: list):
    """(module's children under the file's names, whether any was renamed), the renames appended."""
    aliases = ALIASES.get(level, {})
    names = {name: aliases.get(name, name) for name, _ in module.named_children()}
    if level == "mlp" and any(names[n] != n for n in names):
        names.update({n: "act_fn" for n in names if n in ACTIVATIONS})
    children, changed = {}, False
    for name, child in module.named_children():
        new = names[name]
        if new != name:
            changed = True
            if name not in ACTIVATIONS:
                rename = (f"{PREFIXES[level]}{name}\\.", f"\\1.{new}." if level != "top" else f"{new}.")
                if rename not in renames:
                    renames.append(rename)
        sub = CHILD_LEVELS.get(level, {}).get(new)
        if sub == "layers":
            views = [_view(layer, "layer", renames) for layer in child]
            changed = changed or any(isinstance(v, tuple) for v in views)
            children[new] = [v[0] if isinstance(v, tuple) else v for v in views]
        elif sub is not None:
            viewed = _view(child, sub, renames)
            changed = changed or isinstance(viewed, tuple)
            children[new] = viewed[0] if isinstance(viewed, tuple) else viewed
        else:
            children[new] = child
    return children, changed


def _view(module, level: str, renames: list):
    """(View, ) where something under `module` is renamed, else the module itself."""
    children, changed = _renamed(module, level, renames)
    if not changed:
        return module
    # a View subclass under transformers' class name: the parts' messages name it (type(x).__name__)
    return (type(type(module).__name__, (View,), {})(module, children),)


def view(model) -> tuple:
    """(the model under the file's names, the checkpoint renames, in the order the loader applies them); the model
    itself and () where nothing is renamed."""
    renames: list = []
    viewed = _view(model, "top", renames)
    if not isinstance(viewed, tuple):
        return model, ()
    return viewed[0], tuple(renames)
