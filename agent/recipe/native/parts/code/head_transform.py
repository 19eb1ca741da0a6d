"""A transform of the last hidden states before the output head: dense, activation, norm (modernbert-decoder's
prediction head `lm_head` before its `decoder`), whole on every rank (hidden x hidden; float, as the head)."""

from torch import nn
from transformers.activations import ACT2FN

from module.linear import ReplicatedLinear

from .layer import FIXED_NORM_EPS, NORM_EPS
from .norm_rms import ModelRMSNorm as Norm

HEAD_ACT = "classifier_activation"    # the config key naming the transform's activation
HEAD_DENSE_BIAS = False                # the dense's bias: a literal, or the config key that sets it (classifier_bias)


class ModelHeadTransform(nn.Module):
    """norm(act(dense(x))), the norm the model's own kind (parts/head_transform.py holds it to transformers')."""

    def __init__(self, config, prefix=""):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=HEAD_DENSE_BIAS, quant_config=None,
                                      prefix=f"{prefix}.dense")
        self.act_fn = ACT2FN[getattr(config, HEAD_ACT)]
        self.norm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)

    def forward(self, hidden_states):
        return self.norm(self.act_fn(self.dense(hidden_states)))
