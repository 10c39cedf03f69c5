"""Hugging Face transformers: `fuse_lm_head_loss(model)` keeps a model's training loss in the
compiled graph, with the LM head joined to it (seqfast's fused linear + cross-entropy, which never
builds the full logits).

Two things stand in the way in a model as the library calls it. The model returns its logits, so
the compiled graph must build them (the largest tensor of a step at a large vocabulary). And its
`loss_function` property may log a warning (GPT-2 names no `loss_type`), which breaks Dynamo's
graph, so the loss lands in a second graph without the LM head. The integration resolves the loss
function once, eagerly, and makes a call that computes a loss with grad on return the model's own
output without the logits (`logits` is None). The model's code runs as written: a call without
labels, or with grad off (evaluation), returns what it always did."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Model = TypeVar("Model")
_APPLIED = "_seqfast_fuse_lm_head_loss"


def fuse_lm_head_loss(target: Model) -> Model:
    """Apply the integration to a model (a `transformers.PreTrainedModel`) or to a model class
    (every instance made afterwards); returns `target`. A training call that computes a loss
    (`labels` given, grad on) then returns the model's output with `logits` None; every other call
    is unchanged. Compile the model with seqfast as usual."""
    model_class = target if isinstance(target, type) else type(target)
    _check(model_class)
    if getattr(target, _APPLIED, False):
        return target
    if isinstance(target, type):
        init = target.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _resolve_loss_function(self)

        target.__init__ = __init__
    else:
        _resolve_loss_function(target)
    target.forward = _without_logits_when_training(target.forward)
    setattr(target, _APPLIED, True)
    return target


def _check(model_class: type) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError as error:
        raise ImportError("fuse_lm_head_loss needs the transformers package") from error
    if not issubclass(model_class, PreTrainedModel):
        raise TypeError(
            f"fuse_lm_head_loss takes a transformers PreTrainedModel or its class; got"
            f" {model_class.__name__}"
        )
    if "labels" not in inspect.signature(model_class.forward).parameters:
        raise TypeError(
            f"{model_class.__name__}.forward takes no labels, so it computes no loss to keep in"
            " the graph; apply fuse_lm_head_loss to a model with a head and a loss (a"
            " ...ForCausalLM or ...LMHeadModel class)"
        )


def _resolve_loss_function(model: Any) -> None:
    """Look the loss function up now (the lookup may log, which breaks Dynamo's graph) and keep
    it, so calls read a plain attribute."""
    model.loss_function = model.loss_function


def _without_logits_when_training(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if loss is None or not torch.is_grad_enabled() or getattr(out, "logits", None) is None:
            return out
        return type(out)(**{name: value for name, value in out.items() if name != "logits"})

    return call
