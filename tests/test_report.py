"""seqcompile.explain and the CompileReport it returns."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import seqcompile
from seqcompile.ops import registry
from seqcompile.report import format_bytes


class TwoSites(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.wide = nn.LayerNorm((2, 16))

    def forward(self, x, h):
        y = self.ln(x + F.dropout(self.lin(h), 0.1, self.training))
        return self.wide(y.view(-1, 2, 16))


def test_explain_counts_refusals_kernels_and_memory():
    model = TwoSites().train()
    x, h = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16)
    report = seqcompile.explain(model, x, h)
    assert report.counts == {"norm": 1}
    assert len(report.missed) == 1
    missed = report.missed[0]
    assert missed.pattern == "norm" and "last 2 dimensions" in missed.reason
    assert "wide" in missed.site  # the module path of the refused site
    templates = {k.template for k in report.kernels}
    assert templates == {"add_norm_fwd", "add_norm_bwd", "column_sum"}
    assert all(k.path.exists() for k in report.kernels)
    assert len(report.memory) == 1 and report.memory[0].step.kept_fused_bytes > 0
    text = str(report)
    assert "norm  1" in text and "last 2 dimensions" in text and "add_norm_fwd_" in text
    step = report.memory[0].step
    assert f"fused-op saves {format_bytes(step.kept_fused_bytes)}" in text
    assert "parameters' gradients" in text and "peak" in text


def test_the_report_names_each_familys_operators_and_what_they_keep():
    """From the registry: the operators a counted family makes, and what each operator the
    compile launches keeps for its backward."""
    model = TwoSites().train()
    report = seqcompile.explain(model, torch.randn(4, 16, requires_grad=True), torch.randn(4, 16))
    text = str(report)
    assert "  norm  1  (add_norm)" in text
    assert f"  add_norm: {registry.entry_named('add_norm').saves}" in text


def test_explain_recompiles_a_model_compiled_before():
    model = TwoSites().eval()
    x, h = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        torch.compile(model, backend="seqfast")(x, h)
        first, second = seqcompile.explain(model, x, h), seqcompile.explain(model, x, h)
    assert first.counts == second.counts == {"norm": 1}
    assert first.memory == [] and {k.template for k in first.kernels} == {"add_norm_fwd"}


def test_explain_passes_keyword_arguments():
    report = seqcompile.explain(
        lambda x, *, y: F.layer_norm(x + y, (8,)), torch.randn(2, 8), y=torch.randn(2, 8)
    )
    assert report.counts["norm"] == 1
