"""NPU-native framework models (issue #33, #42): an architecture written as upstream writes its own
(`models/qwen/models/modeling_qwen.py`) from a library of layer parts (agent.recipe.native.parts: one part per
layer kind — its probe of the transformers model, the config keys its code reads, its kernels, its code as plain
Python under parts/code/), and held to transformers before it is written.

`compose.derive` picks one part per slot from the architecture's transformers code and config (a
`Composition`); `assemble.write` inlines the chosen parts' code into one self-contained, pyflakes-clean file
that reads what the family's checkpoints vary in (rope type, biases, tied embeddings, sliding windows, MoE
layout) from the config; `selfcheck` runs the written file on a shrunk config against transformers (float32
and the run dtype, the stand-in's reference kernels; the checkpoint's config and the family's other settings).
`decide` ties them together: a `NativeDecision` says native, or why not (the recipe then keeps the adapter,
`templates/framework/modeling_framework.py.j2`).
"""
