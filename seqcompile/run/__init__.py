"""Run-time code of a compiled step, which stage 6 (lower) wraps around the executor's callables:
the choices made per call, from what autograd and the model's wrappers are doing at that call."""
