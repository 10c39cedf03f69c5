"""Stage 2, normalize: one spelling for each idea, so patterns state their math once.

Each rule is a small named function from a node to its replacement (or None). The stage applies all
rules until none fires and returns how often each fired.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import erase_unused, in_layout_of, tensor_val
from seqcompile.normalize import in_place, loss, matmul, nll, special, spellings, written_out
from seqcompile.normalize.context import Rule, RuleContext
from seqcompile.report import CompileReport

RULES: list[Rule] = [
    Rule("out_of_place", in_place.out_of_place),
    Rule("drop_inactive_dropout", spellings.drop_inactive_dropout),
    Rule("one_cast_spelling", spellings.one_cast_spelling),
    Rule("cast_after_reshape", spellings.cast_after_reshape),
    Rule("div_by_constant", spellings.div_by_constant),
    Rule("square_as_pow", spellings.square_as_pow),
    Rule("rsqrt_spellings", spellings.rsqrt_spellings),
    Rule("mvlgamma_as_lgammas", special.mvlgamma_as_lgammas),
    Rule("frexp_parts", special.frexp_parts),
    Rule("bmm_as_matmul", matmul.bmm_as_matmul),
    Rule("einsum_as_matmul", matmul.einsum_as_matmul),
    Rule("math_written_out", written_out.written_out),
    Rule("softmax_of_shifted", spellings.softmax_of_shifted),
    Rule("negation_inside", nll.negation_inside),
    Rule("nll_rows_written_out", nll.rows_written_out),
    Rule("reduced_rows", nll.reduced_rows),
    Rule("nll_of_log_softmax", loss.nll_of_log_softmax),
    Rule("smoothed_nll_written_out", loss.smoothed_nll_written_out),
]


def normalize_graph(
    gm: GraphModule, fake_mode: Any, rules: list[Rule] = RULES, report: CompileReport | None = None
) -> Counter[str]:
    """Apply `rules` until none fires; returns how many times each one fired. What the rules
    read written out, or refuted, goes to `report`."""
    ctx = RuleContext(gm, fake_mode)
    fired: Counter[str] = Counter()
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            ctx.site = node
            for rule in rules:
                with gm.graph.inserting_before(node):
                    replacement = rule.rewrite(node, ctx)
                if replacement is None:
                    continue
                if isinstance(replacement, Node) and isinstance(tensor_val(node), torch.Tensor):
                    replacement = in_layout_of(ctx, replacement, tensor_val(node))
                node.replace_all_uses_with(replacement)
                erase_unused([node])
                fired[rule.name] += 1
                changed = True
                break
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    if report is not None:
        report.rewritten += [m for kind, m in ctx.notes if kind == "rewritten"]
        report.refuted += [m for kind, m in ctx.notes if kind == "refuted"]
        report.missed += [m for kind, m in ctx.notes if kind == "missed"]
    return fired
