"""torch.compile's `mode` reaches Inductor's compiles of the planned graphs: its settings are on
while they compile, the forward and backward share the CUDA-graph state as Inductor's own compile
shares it, and the parameters are the forward's static inputs. An unknown mode is refused."""

import pytest
import torch
import torch._inductor.compile_fx as compile_fx
from conftest import TOLERANCES
from torch import nn
from torch._inductor import config

from seqcompile.lower.executor import mode_settings
from seqcompile.options import OptionError

COMPILE_FX_INNER = compile_fx.compile_fx_inner


def test_each_mode_maps_to_inductors_settings_and_others_are_refused():
    assert mode_settings(None) == mode_settings("default") == {}
    assert mode_settings("reduce-overhead") == {"triton.cudagraphs": True}
    assert mode_settings("max-autotune")["max_autotune"] is True
    assert mode_settings("max-autotune")["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in mode_settings("max-autotune-no-cudagraphs")
    with pytest.raises(OptionError, match=r"mode must be one of 'default', 'reduce-overhead'"):
        mode_settings("fast")


def test_an_unknown_mode_is_refused_at_the_first_call():
    compiled = torch.compile(nn.Linear(4, 4), backend="seqfast", mode="fastest")
    with pytest.raises(ValueError, match=r"torch.compile's mode must be one of .*got 'fastest'"):
        compiled(torch.randn(2, 4))
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))


@pytest.mark.slow  # Inductor compiles a forward and a backward per mode
@pytest.mark.parametrize(
    "mode, setting", [("reduce-overhead", "triton.cudagraphs"), ("max-autotune", "max_autotune")]
)
def test_the_mode_reaches_inductors_compiles(monkeypatch, mode, setting):
    seen = []

    def spy(gm, example_inputs, **kwargs):
        seen.append((kwargs, config.get_config_copy()[setting]))
        return COMPILE_FX_INNER(gm, example_inputs, **kwargs)

    default = config.get_config_copy()[setting]
    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    monkeypatch.setenv("SEQFAST_REST", "inductor")  # (torch.compile takes a mode or options)
    model = _model()
    x = torch.randn(4, 8, requires_grad=True)
    got = torch.compile(model, backend="seqfast", mode=mode)(x)
    got.square().sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, model(x), **TOLERANCES[torch.float32])

    (forward, on_forward), (backward, on_backward) = seen
    assert on_forward and on_backward, f"{setting} is on while Inductor compiles"
    assert config.get_config_copy()[setting] == default, "and off again after"
    assert forward["cudagraphs"] is backward["cudagraphs"], "one compile's CUDA-graph state"
    assert forward["boxed_forward_device_index"] is backward["boxed_forward_device_index"]
    assert not forward["is_backward"] and backward["is_backward"]
    # the linear's and the norm's weights and biases, not x
    assert len(forward["static_input_idxs"]) == 4


def test_the_eager_executor_runs_under_a_mode_without_cuda_graphs(monkeypatch, caplog):
    model = _model()
    x = torch.randn(4, 8)
    caplog.set_level("INFO", logger="seqcompile")
    got = torch.compile(model, backend="seqfast", mode="reduce-overhead")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, model(x), **TOLERANCES[torch.float32])
    assert "the eager executor runs without CUDA graphs" in caplog.text
