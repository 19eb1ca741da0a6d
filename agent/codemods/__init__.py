"""Every rewrite of Python source the migrator makes, as libcst codemod commands.

vendor: vendoring transformers' modeling code into a recipe · device: CUDA/NPU device code ·
repair: the edits repair rules make. Each command has a CodemodTest (tests/test_codemods*.py,
tests/test_repair_code.py).
"""
