"""Run-time code the operators and the stages share, choosing per call: `runtime.py` (where a
fused operator runs: its kernels, the interpreter or its reference), `settings.py` (the
environment's switches and the error for a bad setting), `copies.py` (the copies
launchers make, counted), `collective_inputs.py` (inputs that are a collective's pending result,
waited for around stage 4's callable)."""
