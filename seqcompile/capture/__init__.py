"""Stage 1, capture: Dynamo's graph traced to pre-dispatch ATen under Dynamo's fake mode
(`trace.py`), autocast regions made explicit casts on the way (`autocast.py`). Loads neither
Triton nor any operator."""

from seqcompile.capture.trace import (
    Uncompilable,
    fake_inputs,
    subclass_in,
    trace_function,
    trace_pre_dispatch,
)

__all__ = ["Uncompilable", "fake_inputs", "subclass_in", "trace_function", "trace_pre_dispatch"]
