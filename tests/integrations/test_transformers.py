"""The transformers integration: a causal LM's training step computes its loss in one compiled
graph with the LM head joined to it (the fused linear + cross-entropy), keeps no tensor of the
logits' size, and matches eager's loss and gradients; calls without labels or with grad off are
unchanged; the Trainer's loss over the tokens of a whole accumulated batch stays correct."""

import copy

import pytest
import torch
from models.real_models import CASES, causal_lm_batch

from seqcompile.integrations.transformers import fuse_lm_head_loss
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

transformers = pytest.importorskip("transformers")
CASE = {case.name: case for case in CASES}
MODELS = ["gpt2", "llama-gqa"]


def model(name):
    torch.manual_seed(0)
    return CASE[name].build("sdpa").train()


def saved_shapes(fn):
    """Run `fn` (once first, to compile it: tracing saves fake tensors) and return the shapes of
    the tensors autograd saves for the backward."""
    fn()
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, shapes


def logits_sized(shapes, vocab, tokens):
    return [s for s in shapes if s and s[-1] == vocab and torch.Size(s).numel() >= tokens * vocab]


@pytest.mark.parametrize("name", MODELS)
def test_the_lm_head_joins_the_loss_in_one_graph_and_the_step_matches_eager(name):
    eager = model(name)
    fast = fuse_lm_head_loss(copy.deepcopy(eager))
    batch = causal_lm_batch()
    expected = eager(**batch).loss
    expected.backward()
    compiled = torch.compile(fast, backend="seqfast")
    with collecting() as report:
        out, shapes = saved_shapes(lambda: compiled(**batch))
        out.loss.backward()
    assert len(report.graphs) == 1, report
    assert {k.op for k in report.kernels} >= {"linear_cross_entropy"}, report
    assert not report.missed, report
    assert out.logits is None
    vocab, tokens = eager.config.vocab_size, batch["input_ids"].numel()
    assert shapes and not logits_sized(shapes, vocab, tokens), shapes
    torch.testing.assert_close(out.loss, expected)
    for (path, p), q in zip(eager.named_parameters(), fast.parameters(), strict=True):
        scale = p.grad.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(q.grad / scale, p.grad / scale, atol=1e-5, rtol=1e-4, msg=path)


def test_logits_changed_before_the_loss_keep_eagers_answer():
    """Gemma 2 soft-caps its logits: the soft cap and the cross-entropy join the linear in
    chunks (a row-wise loss)."""
    config = transformers.Gemma2Config(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.Gemma2ForCausalLM(config).train()
    fast = fuse_lm_head_loss(copy.deepcopy(eager))
    batch = causal_lm_batch()
    expected = eager(**batch).loss
    expected.backward()
    with collecting() as report:
        got = torch.compile(fast, backend="seqfast")(**batch)
        got.loss.backward()
    assert got.logits is None and report.counts["loss"] == 1
    assert any("linear_row_loss" in site for site in report.sites), str(report)
    torch.testing.assert_close(got.loss, expected)
    for p, q in zip(eager.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4)


def test_without_the_integration_the_step_keeps_the_logits():
    """What the test above rules out happens without it (the check can fail)."""
    fast = model("llama-gqa")
    batch = causal_lm_batch()
    compiled = torch.compile(fast, backend="seqfast")
    out, shapes = saved_shapes(lambda: compiled(**batch))
    assert out.logits is not None
    assert logits_sized(shapes, fast.config.vocab_size, batch["input_ids"].numel())


@pytest.mark.parametrize("grad", [True, False], ids=["no labels", "grad off"])
def test_calls_without_a_training_loss_return_the_logits_as_before(grad):
    eager = model("gpt2")
    fast = fuse_lm_head_loss(copy.deepcopy(eager))
    batch = causal_lm_batch()
    if grad:
        batch.pop("labels")
    with torch.set_grad_enabled(grad):
        expected = eager(**batch)
        got = torch.compile(fast, backend="seqfast")(**batch)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-4)
    if not grad:
        torch.testing.assert_close(got.loss, expected.loss)


def test_the_loss_over_a_whole_accumulated_batch_matches_eager():
    """The Trainer passes `num_items_in_batch`: the summed loss over this micro-batch's tokens,
    divided by the tokens of every micro-batch of the step."""
    eager = model("llama-gqa")
    fast = fuse_lm_head_loss(copy.deepcopy(eager))
    batch = dict(causal_lm_batch(), num_items_in_batch=torch.tensor(40))
    expected = eager(**batch).loss
    expected.backward()
    with collecting() as report:
        got = torch.compile(fast, backend="seqfast")(**batch).loss
        got.backward()
    assert "linear_cross_entropy" in {k.op for k in report.kernels}
    torch.testing.assert_close(got, expected)
    for p, q in zip(eager.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4)


def test_a_copy_of_the_model_runs_its_own_parameters():
    """A deep copy (a reference model, an EMA) calls its own forward, not the original's."""
    original = fuse_lm_head_loss(model("gpt2"))
    copied = copy.deepcopy(original)
    with torch.no_grad():
        copied.lm_head.weight.mul_(2)  # tied to the embedding: the copy's logits change
        batch = causal_lm_batch()
        assert not torch.allclose(copied(**batch).logits, original(**batch).logits)
    assert copied(**batch).logits is None and copied(**batch).loss is not None


def test_each_model_keeps_its_own_signature():
    """The Trainer reads it to choose which columns of a dataset to pass."""
    import inspect

    gpt2, llama = fuse_lm_head_loss(model("gpt2")), fuse_lm_head_loss(model("llama-gqa"))
    assert "token_type_ids" in inspect.signature(gpt2.forward).parameters
    assert "token_type_ids" not in inspect.signature(llama.forward).parameters


def test_a_model_class_gets_it_for_every_instance():
    class Tiny(transformers.GPT2LMHeadModel):
        pass

    assert fuse_lm_head_loss(Tiny) is Tiny
    config = model("gpt2").config
    out = torch.compile(Tiny(config), backend="seqfast")(**causal_lm_batch())
    assert out.logits is None and out.loss is not None
    assert transformers.GPT2LMHeadModel(config)(**causal_lm_batch()).logits is not None


@pytest.mark.parametrize(
    "target,message",
    [
        (torch.nn.Linear(2, 2), "takes a transformers PreTrainedModel"),
        (transformers.GPT2Model, "takes no labels"),
    ],
)
def test_what_it_cannot_apply_to_is_refused(target, message):
    with pytest.raises(TypeError, match=message):
        fuse_lm_head_loss(target)


class Tokens(torch.utils.data.Dataset):
    """20 random sequences of 10 tokens, each its own labels."""

    def __init__(self):
        self.ids = torch.randint(3, 101, (20, 10), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trained_losses(tmp_path, seqfast):
    """The losses the Trainer logs over 5 steps of 2 micro-batches of 2 sequences."""
    pytest.importorskip("accelerate")
    net = model("gpt2")
    if seqfast:
        fuse_lm_head_loss(net).compile(backend="seqfast")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("seqfast" if seqfast else "eager")),
        max_steps=5,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=net, args=args, train_dataset=Tokens())
    with collecting() as report:
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], report


def test_five_trainer_steps_log_eagers_losses(tmp_path):
    """The model compiled in place before the Trainer gets it (the Trainer's own
    `torch_compile_backend` accepts only the backends accelerate lists)."""
    expected, _ = trained_losses(tmp_path, seqfast=False)
    got, report = trained_losses(tmp_path, seqfast=True)
    assert len(got) == 5
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(report.graphs) == 1 and "linear_cross_entropy" in {k.op for k in report.kernels}
