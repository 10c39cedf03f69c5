"""Run-time code: the choices a compiled step makes when it runs. `runtime.py` chooses, per
tensor, where a fused operator runs (its kernels, the interpreter or its reference); the rest is
what stage 6 (lower) wraps around the executor's callables, chosen per call from what autograd
and the model's wrappers are doing at that call."""
