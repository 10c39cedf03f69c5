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
import types
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
        init, forward = target.__init__, target.forward

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _resolve_loss_function(self)

        @functools.wraps(forward)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _without_logits_when_training(forward(self, *args, **kwargs))

        target.__init__, target.forward = __init__, call
    else:
        _resolve_loss_function(target)
        if "forward" in vars(target):  # another library's wrapper (a device hook): kept inside
            target._seqfast_inner_forward = vars(target)["forward"]

        # bound to the model, not a closure over it, so that a copy of the model calls its own;
        # with the class forward's signature, which the Trainer reads to choose the inputs
        @functools.wraps(type(target).forward)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _forward(self, *args, **kwargs)

        target.forward = types.MethodType(method, target)
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


def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A model's forward with the integration applied to the model alone."""
    inner = vars(self).get("_seqfast_inner_forward")
    out = inner(*args, **kwargs) if inner is not None else type(self).forward(self, *args, **kwargs)
    return _without_logits_when_training(out)


def _without_logits_when_training(out: Any) -> Any:
    """`out` without its logits when it holds a loss computed with grad on."""
    loss = getattr(out, "loss", None)
    if loss is None or not torch.is_grad_enabled() or getattr(out, "logits", None) is None:
        return out
    return type(out)(**{name: value for name, value in out.items() if name != "logits"})
