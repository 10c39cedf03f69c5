"""The fuse stage's engine: an error while a pattern reads or rewrites one site leaves that site
unfused, the graph as the rewrite found it and the error in the report (warned about once), and
the rest of the graph fused; under `SEQFAST_STRICT` (the suite's setting) the error is raised.
Each family in turn is made to raise at its first site."""

import dataclasses
import functools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from torch import nn

import seqcompile
from seqcompile.capture import trace_function
from seqcompile.fx.nodes import tensor_val
from seqcompile.patterns import pointwise
from seqcompile.patterns.attention import AttentionPattern
from seqcompile.patterns.engine import FuseContext, Refused, Reject, rewritten
from seqcompile.patterns.loss import LossPattern
from seqcompile.patterns.loss.loss_like import LossLikePattern
from seqcompile.patterns.loss.row_loss import RowLossPattern
from seqcompile.patterns.norm import NormPattern
from seqcompile.patterns.user import UserPattern
from seqcompile.report import CompileReport

VOCAB, WIDTH, HEADS, BATCH, LENGTH = 40, 16, 2, 2, 6


def silu_by_hand(x):
    return x * torch.sigmoid(x)


class Tiny(nn.Module):
    """A site of every family: attention, three norms, a pointwise region, the user pattern
    `silu_by_hand`, a row-wise loss (z-loss) and a linear + cross-entropy, and a loss the family
    reports as unfused (`mse_loss`)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln1, self.ln2, self.ln_f = (nn.LayerNorm(WIDTH) for _ in range(3))
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head, self.aux = nn.Linear(WIDTH, VOCAB, bias=False), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, t):
        x = self.emb(idx)
        qkv = self.qkv(self.ln1(x)).view(BATCH, LENGTH, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(BATCH, LENGTH, WIDTH))
        x = x + self.out(silu_by_hand(self.fc(self.ln2(x))) * 0.5)
        logits = self.head(self.ln_f(x))
        ce = F.cross_entropy(logits.flatten(0, 1), t.flatten())
        z_loss = ce + 1e-4 * logits.logsumexp(-1).pow(2).mean()
        aux = F.cross_entropy(self.aux(x).flatten(0, 1), t.flatten())
        return z_loss, aux, F.mse_loss(x, torch.ones_like(x))


FUSED = {"attention": 1, "norm": 3, "loss": 2, "pointwise": 1, "silu_by_hand": 1}
UNFUSED_MSE = "mse_loss is not read as a loss"


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(VOCAB, (BATCH, LENGTH), generator=g) for _ in range(2)]


@pytest.fixture
def model():
    seqcompile.register_pattern("silu_by_hand", silu_by_hand, [torch.randn(4, 8)], F.silu)
    torch.manual_seed(0)
    yield Tiny()
    seqcompile.unregister_pattern("silu_by_hand")


class Injected(RuntimeError):
    """The error a family is made to raise."""


def failing(reader, step, every=False):
    """`reader` (what reads a site: a pattern's `find`, the pointwise fuser's `_fusion`), raising
    `Injected` at the first site it answers for (at every one, with `every`): as it reads the
    site, or once the site's rewrite has changed the graph."""
    raised = []

    @functools.wraps(reader)
    def read(*args):
        found = reader(*args)
        if found is None or (raised and not every):
            return found
        if step == "rewriting" and isinstance(found, Reject):
            return found
        raised.append(found)
        if step == "reading":
            raise Injected(f"injected into {reader.__qualname__}\nat its first site")

        def rewrite(ctx):
            found(ctx)  # inserts, rewires and erases nodes
            raise Injected(f"injected into {reader.__qualname__}'s rewrite")

        return rewrite

    return read


@dataclasses.dataclass
class Family:
    owner: object
    reader: str
    family: str
    """The report's name for it."""
    anchor: str
    """The start of its first site's name."""
    counts: dict[str, int]
    """The counts that change where that site is missed."""
    rewrites: bool = True


FAMILIES = {
    "attention": Family(
        AttentionPattern, "find", "attention", "scaled_dot_product_attention", {"attention": 0}
    ),
    "norm": Family(NormPattern, "find", "norm", "layer_norm (ln1", {"norm": 2}),
    # the cross-entropy then fuses alone, and the z-loss's scale and sum in a region
    "row loss": Family(RowLossPattern, "find", "loss", "linear_4 (head", {"pointwise": 2}),
    "loss": Family(LossPattern, "find", "loss", "cross_entropy_loss_1", {"loss": 1}),
    "loss-like": Family(LossLikePattern, "find", "loss", "mse_loss", {}, rewrites=False),
    # the region fuser takes the match instead
    "user": Family(UserPattern, "find", "silu_by_hand", "mul (", {"silu_by_hand": 0}),
    "pointwise": Family(pointwise, "_fusion", "pointwise", "mul_1", {"pointwise": 0}),
}


def check_site_missed(model, monkeypatch, name, step):
    """With `name`'s first site failing at `step`, the compile fuses the rest, matches eager and
    reports the site, with the error, once."""
    case = FAMILIES[name]
    monkeypatch.setattr(case.owner, case.reader, failing(getattr(case.owner, case.reader), step))
    monkeypatch.delenv("SEQFAST_STRICT")
    missed = [f"{case.family} raised Injected while {step} this site, so it is left unfused"]
    if name != "loss-like":  # (whose site is the mse loss)
        missed.append(UNFUSED_MSE)
    warned = f"{re.escape(case.anchor)}.*Injected while {step}.*injected into"
    with pytest.warns(UserWarning, match=warned):
        report = check_fusion(model, inputs(), counts={**FUSED, **case.counts}, missed=missed)
    (error,) = [m for m in report.missed if "Injected" in m.reason]
    assert error.pattern == case.family
    assert error.site.startswith(case.anchor) and "test_engine.py:" in error.site, error.site
    assert "injected into" in error.reason and "SEQFAST_STRICT=1 raises it" in error.reason


def tiers(names, default):
    return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in sorted(names)]


@pytest.mark.parametrize("name", tiers(FAMILIES, default={"norm", "pointwise"}))
def test_an_error_reading_a_site_leaves_it_unfused_and_raises_under_strict(
    model, monkeypatch, name
):
    case = FAMILIES[name]
    original = getattr(case.owner, case.reader)
    check_site_missed(model, monkeypatch, name, "reading")
    monkeypatch.setattr(case.owner, case.reader, failing(original, "reading"))
    monkeypatch.setenv("SEQFAST_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Injected: injected into"):
        torch.compile(model, backend="seqfast")(*inputs())


@pytest.mark.parametrize(
    "name", tiers([n for n, f in FAMILIES.items() if f.rewrites], default={"user"})
)
def test_an_error_after_a_rewrite_changed_the_graph_puts_the_graph_back(model, monkeypatch, name):
    check_site_missed(model, monkeypatch, name, "rewriting")


@pytest.mark.slow
def test_the_same_error_at_every_site_is_warned_about_once(model, monkeypatch):
    monkeypatch.setattr(NormPattern, "find", failing(NormPattern.find, "reading", every=True))
    monkeypatch.delenv("SEQFAST_STRICT")
    missed = ["norm raised Injected while reading this site"] * 3 + [UNFUSED_MSE]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the residual adds, no longer in a norm, join regions
        counts = {**FUSED, "norm": 0, "pointwise": 3}
        check_fusion(model, inputs(), counts=counts, missed=missed)
    assert len([w for w in caught if "Injected" in str(w.message)]) == 1, caught


@pytest.mark.slow
def test_an_op_whose_reading_fails_ends_its_region_and_is_reported_once(model, monkeypatch):
    """The region fuser reads each op (`refusal`): one that raises joins no region, which ends
    there, and is reported with the error, not again as where the region is split."""
    original = pointwise.refusal

    def refusal(node):
        if node.name == "mul_1":  # the region's last op, `* 0.5`
            raise Injected("injected into refusal")
        return original(node)

    monkeypatch.setattr(pointwise, "refusal", refusal)
    monkeypatch.delenv("SEQFAST_STRICT")
    missed = ["pointwise raised Injected while reading this site", UNFUSED_MSE]
    with pytest.warns(
        UserWarning, match=r"mul_1 \(test_engine.py:\d+\): pointwise raised Injected"
    ):
        check_fusion(model, inputs(), counts=FUSED, missed=missed)


# --------------------------------------------------------------------------------------------
# the graph as a failed rewrite found it

aten = torch.ops.aten


def block(x, y):
    a = torch.relu(x) + y
    return (a * 2).sum(), a


@pytest.fixture
def ctx():
    gm = trace_function(block, [torch.randn(3, 4), torch.randn(3, 4)], "block")
    fake_mode = tensor_val(next(iter(gm.graph.nodes))).fake_mode
    return FuseContext(gm, fake_mode, CompileReport(), training=False)


def named(ctx, name):
    return next(n for n in ctx.gm.graph.nodes if n.name == name)


def state(gm):
    """What says what the graph computes: its nodes in order, each with its inputs, and its code."""
    nodes = [(n, n.name, n.target, n.args, n.kwargs) for n in gm.graph.nodes]
    return nodes, gm.graph.python_code("self").src


def half_done(error, ctx):
    """A rewrite that inserts a seed, swaps `relu` and `add` for other nodes, erases them, moves
    `mul` ahead of what it reads, then raises `error`."""
    relu, add, mul = (named(ctx, name) for name in ("relu", "add", "mul"))
    ctx.seed(torch.device("cpu"))
    sigmoid = ctx.call(aten.sigmoid.default, relu.args[0])
    add.replace_all_uses_with(ctx.call(aten.add.Tensor, sigmoid, add.args[1]))
    ctx.gm.graph.erase_node(add)
    ctx.gm.graph.erase_node(relu)
    next(iter(ctx.gm.graph.nodes)).append(mul)
    raise error


@pytest.mark.parametrize("error", [Injected("half done"), Refused("placements")])
def test_a_rewrite_that_raises_half_way_leaves_the_graph_exactly_as_it_was(ctx, monkeypatch, error):
    monkeypatch.delenv("SEQFAST_STRICT")
    before = state(ctx.gm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not rewritten(ctx, "norm", named(ctx, "mul"), functools.partial(half_done, error))
    assert state(ctx.gm) == before
    ctx.gm.graph.lint()
    assert ctx.seed(torch.device("cpu")) in ctx.gm.graph.nodes  # (not the one taken out)
    (missed,) = ctx.report.missed
    assert (missed.site, missed.pattern) == ("mul", "norm")
    if isinstance(error, Refused):  # a refusal, said as it is, not warned about
        assert missed.reason == "placements" and not caught
    else:
        assert "Injected while rewriting this site" in missed.reason and len(caught) == 1


def test_a_rewrite_that_erases_a_node_still_read_gets_back_what_it_erased(ctx, monkeypatch):
    """FX's error, raised where the rewrite erases a node the graph still reads (`add`, which
    the graph returns): the nodes erased before it are given back their place and inputs."""
    monkeypatch.delenv("SEQFAST_STRICT")
    before = state(ctx.gm)

    def erase_too_much(ctx):
        total = named(ctx, "sum_1")
        total.replace_all_uses_with(ctx.call(aten.sum.default, named(ctx, "arg0_1")))
        for name in ("sum_1", "mul", "add"):
            ctx.gm.graph.erase_node(named(ctx, name))

    with pytest.warns(UserWarning, match="RuntimeError while rewriting.*still had 1 users"):
        assert not rewritten(ctx, "pointwise", named(ctx, "mul"), erase_too_much)
    assert state(ctx.gm) == before


def test_a_rewrite_that_applies_erases_what_it_erased(ctx):
    def swap_relu(ctx):
        relu = named(ctx, "relu")
        relu.replace_all_uses_with(ctx.call(aten.sigmoid.default, relu.args[0]))
        ctx.gm.graph.erase_node(relu)

    relu = named(ctx, "relu")
    assert rewritten(ctx, "pointwise", relu, swap_relu)
    assert relu._erased and "relu" not in state(ctx.gm)[1] and "sigmoid" in state(ctx.gm)[1]


def test_under_strict_a_failed_rewrite_raises_its_error(ctx):
    with pytest.raises(Injected, match="half done"):
        rewritten(
            ctx, "norm", named(ctx, "mul"), functools.partial(half_done, Injected("half done"))
        )
