"""NPU-native framework models (issue #33): a dense or sliding-window architecture written as upstream
writes its own (`models/qwen/models/modeling_qwen.py`), derived from the architecture's transformers
code and config, and held to transformers before it is written.

`features.derive` reads what the architecture is (module tree, formulas probed numerically, config
facts) into a `NativeFeatures`; `templates/framework/native/modeling.py.j2` writes the file from it;
`selfcheck` runs the written file on a shrunk config against transformers (fp32, the stand-in's
reference kernels). `decide` ties them together: a `NativeDecision` says native, or why not (the
recipe then keeps the adapter, `templates/framework/modeling_framework.py.j2`).
"""


