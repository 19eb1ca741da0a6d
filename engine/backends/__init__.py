"""One module per device backend (npu, cuda, cpu) behind engine.environment; common.py has what they share."""
