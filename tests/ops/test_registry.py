"""The registry of fused operators: each fact that two stages used to compute apart (the kernels a
fused call launches, its FLOPs, its workspace, its in-place twin, its accumulation hook) is read
from one entry, and the stages agree with it."""

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from checks import TINY_GPT, tiny_gpt_batch
from fuzz.test_differential import FAMILIES as FUZZED_FAMILIES

import seqcompile.backend as backend
from benchmarks import KERNEL_BENCHMARKS
from ops.test_samples import gpu_cases
from seqcompile.codegen import counting_launches
from seqcompile.demo import GPT
from seqcompile.memory.cost import node_cost
from seqcompile.memory.liveness import step_memory
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.patterns import FAMILIES, builtin_patterns
from seqcompile.patterns.pointwise import FAMILY as REGION_FAMILY
from seqcompile.report import collecting


def _compiled_graphs(model, *inputs, options=None):
    """Compile `model`, run one step, and return the report and the forward and backward graphs
    stage 5 handed to the executor."""
    graphs = {}
    original = backend.plan_memory

    def keep(*args, **kwargs):
        plan = original(*args, **kwargs)
        graphs["forward"], graphs["backward"] = plan.forward, plan.backward
        return plan

    with pytest.MonkeyPatch.context() as patch, collecting() as report:
        patch.setattr(backend, "plan_memory", keep)
        out = torch.compile(model, backend="seqfast", options=options)(*inputs)
        out.sum().backward()
    return report, graphs["forward"], graphs["backward"]


class NormBlock(nn.Module):
    """x + dropout(linear(h)) then a norm; the sum is read again (the next residual)."""

    def __init__(self, rms: bool, dropout: float):
        super().__init__()
        self.proj = nn.Linear(24, 24)
        self.norm = nn.RMSNorm(24) if rms else nn.LayerNorm(24)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, h):
        total = x + self.dropout(self.proj(h))
        return self.norm(total) * 2 + total


@pytest.mark.slow
@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd", "column_sum", "attention_fwd", "pointwise")
@pytest.mark.parametrize("rms, dropout", [(False, 0.0), (True, 0.1)])
def test_the_kernels_a_compile_lists_are_the_kernels_its_step_launches(interpret, rms, dropout):
    """The compile derives each call's kernels from the registry at the traced sizes; the
    launchers derive them from their arguments with the same function: the two sets agree."""
    torch.manual_seed(0)
    model = NormBlock(rms, dropout).train()
    x, h = torch.randn(2, 5, 24, requires_grad=True), torch.randn(2, 5, 24, requires_grad=True)
    with counting_launches() as launches:
        report, forward, backward = _compiled_graphs(model, x, h)
    _assert_listed_kernels_launched(report, launches)
    ops = {use.op for use in report.kernels}
    assert "add_norm" in ops
    assert {use.direction for use in report.kernels} == {"forward", "backward"}

    gpt = GPT(TINY_GPT).train()
    with counting_launches() as launches:
        report, _, _ = _compiled_graphs(lambda i, t: gpt(i, t), *tiny_gpt_batch(length=12))
    _assert_listed_kernels_launched(report, launches)
    assert {"attention", "add_norm", "linear_cross_entropy"} <= {u.op for u in report.kernels}


def _assert_listed_kernels_launched(report, launches):
    listed, launched = {use.source.name for use in report.kernels}, set(launches.files())
    assert listed <= launched, f"listed kernels never launched: {listed - launched}"
    assert launched <= listed, f"kernels launched but not listed: {launched - listed}"


def test_fused_calls_are_read_by_argument_name():
    inputs = (torch.randn(2, 5, 24, requires_grad=True), torch.randn(2, 5, 24, requires_grad=True))
    _, forward, _ = _compiled_graphs(NormBlock(rms=False, dropout=0.0), *inputs)
    (norm,) = [n for n in forward.graph.nodes if n.target is torch.ops.seqfast.add_norm.default]
    call = Call.of(norm)
    assert call["eps"] == 1e-5 and call["rms"] is False and call["p"] == 0.0
    assert call.value("x").shape == (2, 5, 24)
    assert list(call.arguments(eps=0.5)) == [0.5 if k == "eps" else call[k] for k in call]
    with pytest.raises(TypeError, match="no argument"):
        call.arguments(epsilon=0.5)


def test_attention_flops_and_workspace_come_from_its_entry_for_the_cost_and_memory_models():
    """The roofline's price of a fused attention is the entry's formula: 2 products of
    B*H*Lq*Lk*D multiply-adds forward, 5 backward. The memory model adds the backward's
    workspace while it runs: a float32 delta per query row and, for a learned bias, its gradient
    at the scores' full size."""
    b, h, lq, lk, d = 2, 3, 7, 9, 8
    bias = torch.randn(1, h, lq, lk, requires_grad=True)

    def attend(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    q = torch.randn(b, h, lq, d, requires_grad=True)
    k, v = (torch.randn(b, h, lk, d, requires_grad=True) for _ in range(2))
    _, forward, backward = _compiled_graphs(attend, q, k, v, bias)
    (node,) = [n for n in forward.graph.nodes if n.target is torch.ops.seqfast.attention.default]
    assert registry.flops_of(node) == 2 * b * h * lq * lk * (d + d) == node_cost(node).flops
    (grad,) = [
        n for n in backward.graph.nodes if n.target is torch.ops.seqfast.attention_backward.default
    ]
    assert registry.flops_of(grad) == 2 * b * h * lq * lk * (3 * d + 2 * d)
    assert node_cost(grad).flops == registry.flops_of(grad)
    assert registry.workspace_of(grad) == 4 * b * h * lq * (1 + lk)
    with_workspace = step_memory(forward, backward, 1, set())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "workspace_of", lambda n: 0)
        without = step_memory(forward, backward, 1, set())
    assert with_workspace.peak_bytes > without.peak_bytes


def test_attention_workspace_holds_dq_in_float32_where_one_launch_adds_it():
    """In 16 bits at head dim 64 the backward's default is one launch, which adds dq in float32
    before rounding it: its workspace holds that sum beside the row deltas."""
    b, h, n, d = 1, 2, 5, 64
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    _, _, backward = _compiled_graphs(F.scaled_dot_product_attention, q, k, v)
    (grad,) = [
        n for n in backward.graph.nodes if n.target is torch.ops.seqfast.attention_backward.default
    ]
    assert registry.workspace_of(grad) == 4 * b * h * n * (1 + d)


@pytest.mark.parametrize("frozen, products", [(False, 3), (True, 2)])
def test_the_fused_loss_flops_count_the_gradients_it_makes(frozen, products):
    hidden = torch.randn(16, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=not frozen)
    target = torch.randint(0, 40, (16,))
    _, forward, _ = _compiled_graphs(
        lambda h, w, t: F.cross_entropy(F.linear(h, w), t), hidden, weight, target
    )
    (node,) = [
        n for n in forward.graph.nodes if n.target is torch.ops.seqfast.linear_cross_entropy.default
    ]
    assert registry.flops_of(node) == 2 * products * 16 * 8 * 40 == node_cost(node).flops


def test_the_fused_loss_workspace_is_counted_at_its_node():
    """The memory model adds the linear + cross-entropy's workspace (a chunk of logits and of
    `dlogits @ weight`) while that node runs, as the entry gives it: with narrow features and
    one chunk of every row, the workspace sets the step's peak."""
    hidden = torch.randn(64, 2, requires_grad=True)
    weight = torch.randn(40, 2, requires_grad=True)
    target = torch.randint(0, 40, (64,))

    def loss(hidden, weight, target):
        return F.cross_entropy(F.linear(hidden, weight), target)

    _, forward, backward = _compiled_graphs(
        loss, hidden, weight, target, options={"loss_chunk": 64}
    )
    (node,) = [
        n for n in forward.graph.nodes if n.target is torch.ops.seqfast.linear_cross_entropy.default
    ]
    assert registry.workspace_of(node) == 64 * (40 + 2) * 4  # float32 throughout
    with_workspace = step_memory(forward, backward, 1, set())
    assert with_workspace.peak_node == node.name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "workspace_of", lambda n: 0)
        without = step_memory(forward, backward, 1, set())
    assert without.peak_node != node.name
    assert with_workspace.peak_bytes > without.peak_bytes


def test_the_in_place_twin_of_the_loss_backward_is_the_entrys():
    """Stage 5 swaps a backward op for the twin its entry names, writing over the argument the
    entry names, and the report says which variant the backward took."""
    logits = torch.randn(12, 30, requires_grad=True)
    target = torch.randint(0, 30, (12,))

    def loss(logits, target):
        return F.cross_entropy(logits * 2, target)

    # kept, not recomputed from `logits` (what the planner does with no budget): the twin writes
    # over saved tensors only
    report, _, backward = _compiled_graphs(loss, logits, target, options={"checkpoint": "none"})
    entry = registry.entry_of(torch.ops.seqfast.cross_entropy.default)
    targets = {n.target for n in backward.graph.nodes}
    assert entry.in_place.twin in targets and entry.in_place.functional not in targets
    (variant,) = report.variants
    assert "in-place variant" in variant


def test_the_loss_accumulates_its_weight_gradient_through_its_entrys_hook():
    hidden = torch.randn(16, 8, requires_grad=True)
    head = nn.Linear(8, 40, bias=False)
    target = torch.randint(0, 40, (16,))

    def loss(hidden, target):
        return F.cross_entropy(head(hidden), target)

    report, _, backward = _compiled_graphs(loss, hidden, target, options={"accumulate_grads": True})
    targets = [n.target for n in backward.graph.nodes]
    assert torch.ops.seqfast.accumulate_scaled_.default in targets
    (variant,) = [v for v in report.variants if "linear_cross_entropy" in v]
    assert "accumulation hook" in variant
    assert registry.entry_of(torch.ops.seqfast.linear_cross_entropy.default).accumulate


def test_every_entry_names_its_ops_and_kernels():
    for entry in registry.ENTRIES:
        assert entry.forward in entry.kernels
        assert all(op in entry.kernels for op in entry.ops), entry.name
        assert all(op in entry.lowering for op in entry.ops), f"{entry.name}: a lowering per op"
        assert all(registry.entry_of(op) is entry for op in entry.ops)
        assert entry.saves and entry.reference is not None
    assert registry.entry_of(torch.ops.aten.add.Tensor) is None


def test_every_entry_is_a_whole_definition():
    """Family, samples, reference, kernels and saves: what the stages, the report and the tests
    read from an entry, declared by each."""
    for entry in registry.ENTRIES:
        assert entry.family in ("attention", "norm", "loss", "pointwise"), entry.name
        assert list(entry.samples()), f"{entry.name} declares no sample inputs"
        assert callable(entry.reference) and entry.kernels and entry.saves, entry.name
        assert registry.entry_named(entry.name) is entry
        assert entry in registry.entries_of(entry.family)
    with pytest.raises(KeyError, match="add_norm"):
        registry.entry_named("layer_norm")


def test_the_families_and_the_operator_lists_are_the_registrys():
    """The report's families, the patterns' (the built-in patterns and the pointwise region
    fuser), the fuzzer's, the operators the GPU tier runs (each entry's samples on CUDA) and the
    benchmarks (each entry's `benchmark`, a module that exists) are the registry's (the Hopper
    compile, `tests/codegen/test_hopper_compile.py`, covers each entry from its samples)."""
    assert FAMILIES == FUZZED_FAMILIES == registry.FAMILIES
    made_by = {pattern.family for pattern in builtin_patterns()} | {REGION_FAMILY}
    assert made_by == set(registry.FAMILIES), "a family without a pattern, or the reverse"
    assert {entry.name for entry in gpu_cases()} == {entry.name for entry in registry.ENTRIES}
    assert KERNEL_BENCHMARKS == {entry.name: entry.benchmark for entry in registry.ENTRIES}
    for entry in registry.ENTRIES:
        assert importlib.util.find_spec(entry.benchmark) is not None, entry.benchmark


def test_every_entry_runs_its_reference_on_cpu(monkeypatch):
    """`FusedOp.reference` is what the op runs on CPU tensors (for linear + cross-entropy, the
    op itself, whose chunks run the cross-entropy's reference)."""
    for entry in registry.ENTRIES:
        if getattr(entry.reference, "_opoverload", None) is entry.forward:
            continue
        calls = []
        module = inspect.getmodule(entry.reference)
        name = entry.reference.__name__

        def spy(*args, reference=entry.reference, calls=calls, **kwargs):
            calls.append(args)
            return reference(*args, **kwargs)

        with monkeypatch.context() as patched:
            patched.setattr(module, name, spy)
            entry.forward(**next(iter(entry.samples())).args)
        assert calls, f"{entry.name}: the forward on CPU did not run {module.__name__}.{name}"


def test_the_design_docs_registry_table_names_every_entry_and_its_family():
    text = (Path(__file__).parents[2] / "docs" / "design.md").read_text()
    for entry in registry.ENTRIES:
        assert f"| `{entry.name}` | {entry.family} |" in text, entry.name


OPS = Path(registry.__file__).parent
PARTS = ("__init__.py", "op.py", "reference.py", "sharding.py", "samples.py")
"""What every operator's folder holds (`docs/design.md`, "One folder per operator")."""


def test_every_operator_is_one_folder_with_the_same_parts():
    folders = {path.parent.name for path in OPS.glob("*/__init__.py")}
    assert folders == {entry.name for entry in registry.ENTRIES}, (
        "a folder with no entry, or the reverse"
    )
    for entry in registry.ENTRIES:
        assert entry.package == f"seqcompile.ops.{entry.name}"
        assert importlib.import_module(entry.package).ENTRY is entry
        missing = [part for part in PARTS if not (OPS / entry.name / part).exists()]
        assert not missing, f"{entry.name} lacks {missing}"
        assert callable(importlib.import_module(f"{entry.package}.samples").samples)


def test_each_template_lives_in_one_folder():
    """An operator's templates sit in its folder, the pieces operators share in
    `codegen/templates/`; the renderer finds them by name, so no two may share one."""
    names = [path.name for path in OPS.parent.rglob("*.py.jinja")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_no_module_of_the_package_imports_an_operators_samples():
    """Samples are test data: a compile never loads them (`FusedOp.samples()` imports them when
    a test or a sweep asks); only samples import samples."""
    for path in OPS.parent.rglob("*.py"):
        if path.name == "samples.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            loaded = [n for n in names if n.endswith(".samples") and n != "seqcompile.ops.samples"]
            assert not loaded, f"{path}:{node.lineno} imports {loaded}"


def _parameters(path: Path) -> list[tuple[str, set[str]]]:
    """Each function defined in the file at `path` (nested ones too): its name and line, and the
    names of its parameters."""
    functions = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            functions.append((f"{path.name}:{node.lineno} {node.name}", {a.arg for a in arguments}))
    return functions


def test_no_function_retypes_an_ops_parameter_list():
    """An op's arguments are written once, in its schema: no function of the operators' folders
    or of the modules they share takes every argument of an op as a named parameter. Ops of six
    arguments or fewer are let be (the cross-entropy's list reads at a glance)."""
    functions = [f for path in OPS.rglob("*.py") for f in _parameters(path)]
    for entry in registry.ENTRIES:
        for op in entry.ops:
            names = {argument.name for argument in op._schema.arguments}
            if len(names) <= 6:
                continue
            retyped = [where for where, parameters in functions if names <= parameters]
            assert not retyped, f"{op} is retyped by {retyped}"
