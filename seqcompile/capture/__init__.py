"""Stage 1, capture: Dynamo's graph traced to pre-dispatch ATen under Dynamo's fake mode
(`trace.py`), autocast regions made explicit casts on the way (`autocast.py`); a graph it cannot
keep correct runs as captured (`as_captured.py`). Loads neither Triton nor any operator."""

from seqcompile.capture.as_captured import as_captured, captured_if_first_call_fails, subclass_in
from seqcompile.capture.trace import Uncompilable, fake_inputs, trace_function, trace_pre_dispatch

__all__ = [
    "Uncompilable",
    "as_captured",
    "captured_if_first_call_fails",
    "fake_inputs",
    "subclass_in",
    "trace_function",
    "trace_pre_dispatch",
]
