"""Random programs for the differential fuzzer: compositions of the spellings docs/ lists for
attention, residual + norm, pointwise regions and the loss, written out as Python source (so a
failing program prints as a script), at random sizes, memory layouts and dtypes, from one seed."""

from __future__ import annotations

import dataclasses
import functools
import linecache
import math
import random
from collections import Counter
from typing import Any

import torch

from fuzz import positions

HELPERS = '''
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def leaf(g, shape, dtype, layout="contiguous", scale=1.0, grad=True):
    """Normal values of `shape`, laid out in memory as `layout` says: contiguous, transposed
    (first and last dims swapped), sliced (every other element of a wider last dim), offset
    (one row into its storage) or expanded (stride 0 in the first dim)."""
    shape = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        alloc = [shape[-1], *shape[1:-1], shape[0]]
        t = (torch.randn(alloc, generator=g) * scale).to(dtype).transpose(0, -1)
    elif layout == "sliced":
        t = (torch.randn([*shape[:-1], 2 * shape[-1]], generator=g) * scale).to(dtype)[..., ::2]
    elif layout == "offset":
        t = (torch.randn([shape[0] + 1, *shape[1:]], generator=g) * scale).to(dtype)[1:]
    elif layout == "expanded":
        t = (torch.randn([1, *shape[1:]], generator=g) * scale).to(dtype).expand(shape)
    else:
        t = (torch.randn(shape, generator=g) * scale).to(dtype)
    return t.requires_grad_(grad)


def keep(g, shape):
    """A boolean mask, True where a key is kept; key 0 is kept in every row."""
    k = torch.rand(shape, generator=g) >= 0.3
    k[..., 0] = True
    return k


def additive(g, shape, dtype, fill):
    """An additive float mask: 0 where a key is kept, `fill` elsewhere."""
    return torch.zeros(shape, dtype=dtype).masked_fill(~keep(g, shape), fill)


def targets(g, shape, classes, ignore=None):
    """Class indices; with `ignore`, about a quarter of them are `ignore` (never the first)."""
    t = torch.randint(classes, shape, generator=g)
    if ignore is not None:
        drop = torch.rand(shape, generator=g) < 0.25
        drop.view(-1)[0] = False
        t = t.masked_fill(drop, ignore)
        if t.view(-1)[0] == ignore:  # an ignore index that is a class can be drawn too
            t.view(-1)[0] = (ignore + 1) % classes
    return t


def target_storage(g, t, classes, layout, rows=1):
    """A tensor holding the class indices `t` where `TARGET_VIEWS[layout]` reads them: every other
    element ("stepped"), the second column of pairs ("column"), from its second element on
    ("offset"), its first element alone ("expanded": all targets are t[0]), or each of `rows`
    rows from its second element on ("shifted", as labels are tokens shifted by one). Its other
    elements are other class indices, so a read that ignores the strides gets other targets."""
    n = t.numel()
    if layout == "stepped":
        base = torch.randint(classes, [2 * n], generator=g)
        base[::2] = t
    elif layout == "column":
        base = torch.randint(classes, [n, 2], generator=g)
        base[:, 1] = t
    elif layout == "offset":
        base = torch.randint(classes, [n + 1], generator=g)
        base[1:] = t
    elif layout == "shifted":
        base = torch.randint(classes, [rows, n // rows + 1], generator=g)
        base[:, 1:] = t.view(rows, -1)
    else:
        base = t[:1].clone()
    return base


def laid_out(g, t, classes, layout):
    """`t` as a view of the larger tensor `target_storage` makes."""
    base = target_storage(g, t, classes, layout)
    return {
        "stepped": lambda: base[::2],
        "column": lambda: base[:, 1],
        "offset": lambda: base[1:],
        "expanded": lambda: base.expand(t.numel()),
    }[layout]()


def weights(outs):
    """Fixed random weights that project `outs` to a scalar loss."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(o.shape, generator=g) for o in outs]


def project(outs, ws):
    return sum((o.float() * r).sum() for o, r in zip(outs, ws))


def randomized(g, module):
    """`module` with every parameter drawn at random (norm weights around 1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (name == "weight"))
    return module
'''
"""Helpers the generated sources call; part of every program's namespace and of its script."""

DTYPES = {t: str(t) for t in (torch.float32, torch.bfloat16, torch.float16)}
LAYOUTS = ["contiguous"] * 4 + ["transposed", "sliced", "offset"]
LOOSENESS = [torch.float32, torch.float16, torch.bfloat16]
TARGET_VIEWS = {
    "stepped": "{}[::2]",
    "column": "{}[:, 1]",
    "offset": "{}[1:]",
    "expanded": "{}.expand({n})",
    "shifted": "{}[:, 1:].reshape(-1)",
}
"""How a program reads its targets out of `target_storage`'s tensor (`laid_out` reads the same
for targets passed in laid out so)."""


@dataclasses.dataclass
class Program:
    """One generated program: `build(g)` makes the module holding its parameters, `inputs(g)`
    its arguments, `program(m, *inputs)` returns a tuple of float tensors."""

    seed: int
    name: str
    """`seed=S`, and `only=[...]` for a program of some of the seed's blocks."""
    summary: str
    source: str
    """The three functions, with `DROPOUT_P` where every dropout's probability goes."""
    dtype: torch.dtype
    tolerance: torch.dtype
    """The dtype whose tolerance the comparisons take: the lowest precision the program uses."""
    promised: Counter[str]
    """Sites the family pages say fuse: attention, norm and loss exactly, pointwise at least."""
    dropout: float
    """The probability of the dropout run (0: none; the values are compared at p=0 anyway)."""
    dropped_outputs: tuple[int, ...]
    """Outputs that leave through a dropout, whose keep ratio and scaling are checked."""
    project_inside: bool
    """Whether the compiled function also projects the outputs to the scalar loss."""
    blocks: int
    kinds: Counter[str]
    """How often each kind of the newer generators (masks and biases from positions, target
    layouts) was drawn."""

    def text(self, p: float) -> str:
        return self.source.replace("DROPOUT_P", repr(p))

    def namespace(self, p: float) -> dict[str, Any]:
        """The helpers and the program's functions, compiled from a file name that tracebacks
        can show."""
        namespace = dict(_helpers())
        _run(self.text(p), f"<fuzz program {self.name} p={p}>", namespace)
        return namespace

    def script(self, p: float = 0.0) -> str:
        """A standalone script comparing seqfast with eager on this program."""
        return (
            f"# {self.summary}\n{HELPERS}\n{self.text(p)}\n"
            f"def run(backend):\n"
            f"    g = torch.Generator().manual_seed({self.seed})\n"
            f"    m, xs = build(g), inputs(g)\n"
            f"    fn = lambda *a: program(m, *a)\n"
            f"    outs = (torch.compile(fn, backend=backend) if backend else fn)(*xs)\n"
            f"    project(outs, weights(outs)).backward()\n"
            f"    leaves = [x for x in xs if x.requires_grad] + list(m.parameters())\n"
            f"    return [o.detach() for o in outs], [t.grad for t in leaves]\n\n\n"
            f"(eo, eg), (fo, fg) = run(None), run('seqfast')\n"
            f"for a, e in zip(fo + fg, eo + eg):\n"
            f"    print((a.float() - e.float()).abs().max().item() if a is not None else (a, e))\n"
        )


def _run(text: str, filename: str, namespace: dict[str, Any]) -> None:
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec"), namespace)


@functools.cache
def _helpers() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    _run(HELPERS, "<fuzz helpers>", namespace)
    return namespace


class Writer:
    """Collects a program's parameters, inputs and body lines while the spellings are drawn."""

    def __init__(self, rng: random.Random, dtype: torch.dtype):
        self.rng, self.dtype = rng, dtype
        self.dt = DTYPES[dtype]
        self.tolerance = dtype
        self.params: list[str] = []
        self.inputs: list[tuple[str, str]] = []
        self.body: list[str] = []
        self.outputs: list[str] = []
        self.notes: list[str] = []
        self.promised: Counter[str] = Counter()
        self.dropouts = 0
        self.dropped: list[int] = []
        self.kinds: Counter[str] = Counter()
        self.n = 0

    def rounds_to(self, dtype: torch.dtype) -> None:
        """The program rounds to `dtype` somewhere: its results compare at that tolerance (a
        gradient rounded to fp16 takes the neighbouring value for the smallest change)."""
        if LOOSENESS.index(dtype) > LOOSENESS.index(self.tolerance):
            self.tolerance = dtype

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def param(self, prefix: str, shape: list[int], scale: float = 1.0) -> str:
        name = self.name(prefix)
        self.params.append(
            f"m.{name} = nn.Parameter(leaf(g, {shape}, {self.dt}, scale={scale:.3g}))"
        )
        return f"m.{name}"

    def module(self, prefix: str, constructor: str) -> str:
        name = self.name(prefix)
        self.params.append(f"m.{name} = randomized(g, {constructor}.to({self.dt}))")
        return f"m.{name}"

    def input(self, prefix: str, expr: str) -> str:
        name = self.name(prefix)
        self.inputs.append((name, expr))
        return name

    def leaf(self, prefix: str, shape: list[int], layout: str | None = None, **kw: Any) -> str:
        layout = layout or self.rng.choice(LAYOUTS)
        extra = "".join(f", {k}={v!r}" for k, v in kw.items())
        return self.input(prefix, f"leaf(g, {shape}, {self.dt}, {layout!r}{extra})")

    def let(self, prefix: str, expr: str) -> str:
        name = self.name(prefix)
        self.body.append(f"{name} = {expr}")
        return name

    def dropout(self, x: str) -> str:
        self.dropouts += 1
        return f"F.dropout({x}, p=DROPOUT_P, training=True)"

    def output(self, name: str) -> None:
        self.outputs.append(name)

    def note(self, text: str) -> None:
        self.notes.append(text)


def pick(rng: random.Random, *weighted: tuple[Any, float]) -> Any:
    values, weights = zip(*weighted, strict=True)
    return rng.choices(values, weights)[0]


# ---------------------------------------------------------------------------------------------
# attention


def attention(w: Writer, q: str, k: str, v: str, dims: dict[str, int], causal: bool) -> str:
    """Attention of (B, H, L, D) q, k, v in a random spelling; returns the (B, H, Lq, D) output.
    `causal` asks for a causal mask in whichever spelling is drawn."""
    rng = w.rng
    w.promised["attention"] += 1
    style = pick(rng, ("sdpa", 3), ("matmul", 3), ("einsum", 1), ("bmm", 1), ("baddbmm", 1))
    if dims["Hkv"] != dims["H"]:
        style = "sdpa"
    terms = None
    if rng.random() < 0.6:
        terms = positions.site_terms(w, dims, style, q, _helpers())
    if terms is not None:
        causal = False  # the terms take the place of the other masks
        w.note(f"positions[{', '.join(terms.notes)}]")
    return (_sdpa if style == "sdpa" else _written_attention)(
        w, q, k, v, dims, causal, style, terms
    )


def _mask_input(w: Writer, kind: str, shape: list[int]) -> str:
    rng = w.rng
    if kind == "bool":
        return w.input("keep", f"keep(g, {shape})")
    if kind == "float":
        fill = rng.choice(["float('-inf')", f"torch.finfo({w.dt}).min"])
        return w.input("amask", f"additive(g, {shape}, {w.dt}, {fill})")
    grad = rng.random() < 0.6
    layout = "contiguous" if grad else rng.choice(["contiguous", "expanded", "transposed"])
    return w.leaf("bias", shape, layout, scale=0.5, grad=grad)


def _sdpa(w: Writer, q, k, v, dims, causal, style, terms) -> str:
    rng = w.rng
    B, H, Lq, Lk = dims["B"], dims["H"], dims["Lq"], dims["Lk"]
    kwargs, notes = [], []
    if terms is not None:
        kwargs.append(f"attn_mask={terms.sdpa}")
        notes.append("mask from positions")
    elif causal:
        kwargs.append("is_causal=True")
        notes.append("is_causal")
    elif rng.random() < 0.6:
        kind = rng.choice(["bool", "float", "bias"])
        shape = rng.choice([[B, 1, 1, Lk], [B, 1, Lq, Lk], [Lq, Lk], [1, H, Lq, Lk], [H, 1, Lk]])
        kwargs.append(f"attn_mask={_mask_input(w, kind, shape)}")
        notes.append(f"{kind} mask {tuple(shape)}")
    if rng.random() < 0.4:
        scale = rng.choice([0.3, 1.0, round(dims["D"] ** -0.5, 4)])
        kwargs.append(f"scale={scale}")
        notes.append(f"scale={scale}")
    if dims["Hkv"] != H:
        kwargs.append("enable_gqa=True")
        notes.append(f"gqa {H}/{dims['Hkv']}")
    if rng.random() < 0.2:
        w.dropouts += 1
        kwargs.append("dropout_p=DROPOUT_P")
        notes.append("dropout")
    w.note(f"sdpa({', '.join(notes)})")
    return w.let("att", f"F.scaled_dot_product_attention({q}, {k}, {v}, {', '.join(kwargs)})")


def _written_attention(w: Writer, q, k, v, dims, causal, style, terms) -> str:
    rng = w.rng
    B, H, Lq, Lk, D = dims["B"], dims["H"], dims["Lq"], dims["Lk"], dims["D"]
    flat = style in ("bmm", "baddbmm")
    notes = [style]
    scale_at = rng.choice(["scores", "scores", "q", "qk", "none"])
    scale = rng.choice([f"math.sqrt({D})", f"{D} ** 0.5", "8.0"])
    if scale_at == "q":
        q = w.let("qs", rng.choice([f"{q} / {scale}", f"{q} * (1.0 / {scale})"]))
    elif scale_at == "qk":
        q = w.let("qs", f"{q} * ({scale}) ** -0.5")
        k = w.let("ks", f"{k} * ({scale}) ** -0.5")
    notes.append(f"scale on {scale_at}")
    if flat:
        q, k, v = (
            w.let(n, f"{t}.reshape({B * H}, -1, {D})")
            for n, t in zip("qkv", (q, k, v), strict=True)
        )
    bias = None
    if rng.random() < 0.4 or style == "baddbmm":
        shapes = (
            [[B * H, 1, Lk], [B * H, Lq, Lk], [Lq, Lk]]
            if flat
            else [[B, 1, 1, Lk], [B, 1, Lq, Lk], [1, H, Lq, Lk], [Lq, Lk], [H, 1, 1]]
        )
        shape = rng.choice(shapes)
        bias = _mask_input(w, rng.choice(["bias", "bias", "float"]), shape)
        notes.append(f"bias {tuple(shape)}")
    if style == "baddbmm":
        alpha = f"1.0 / {scale}" if scale_at == "scores" else "1.0"
        beta = rng.choice(["1.0", "0.5"])
        s = w.let(
            "s", f"torch.baddbmm({bias}, {q}, {k}.transpose(1, 2), beta={beta}, alpha={alpha})"
        )
        bias = None
    else:
        s = w.let(
            "s",
            {
                "bmm": f"torch.bmm({q}, {k}.transpose(1, 2))",
                "einsum": f"torch.einsum('bhqd,bhkd->bhqk', {q}, {k})",
                "matmul": rng.choice(
                    [
                        f"{q} @ {k}.transpose(-1, -2)",
                        f"torch.matmul({q}, {k}.transpose(-2, -1))",
                        f"{q} @ {k}.permute(0, 1, 3, 2)",
                    ]
                ),
            }[style],
        )
        bias_first = bias is not None and rng.random() < 0.3
        if bias_first:
            s = w.let("s", f"{s} + {bias}")
        if scale_at == "scores":
            s = w.let("s", rng.choice([f"{s} / {scale}", f"{s} * (1.0 / {scale})"]))
        if bias is not None and not bias_first:
            s = w.let("s", f"{s} + {bias}")
    fill = rng.choice(["float('-inf')", "torch.finfo(s.dtype).min"])
    if w.dtype == torch.float32 and rng.random() < 0.3:
        fill = "-1e9"
    fill = fill.replace("s.dtype", f"{s}.dtype")
    if causal:
        triangle = rng.choice(
            [
                (True, f"torch.tril(torch.ones({Lq}, {Lk}, dtype=torch.bool))"),
                (False, f"torch.triu(torch.ones({Lq}, {Lk}), diagonal=1).bool()"),
                (False, f"torch.tril(torch.ones({Lq}, {Lk})) == 0"),
            ]
        )
        s = w.let("s", _apply_mask(rng, s, triangle, fill))
        notes.append("tril causal")
    if terms is not None:  # after the biases: a finite fill comes last (see `site_terms`)
        for term in terms.written:
            s = w.let("s", term(s))
        notes.append("mask from positions")
    elif not flat and rng.random() < 0.4:
        shape = rng.choice([[B, 1, 1, Lk], [B, 1, Lq, Lk], [Lq, Lk]])
        s = w.let("s", _apply_mask(rng, s, (True, _mask_input(w, "bool", shape)), fill))
        notes.append(f"bool mask {tuple(shape)}")
    upcast = rng.random() < 0.35
    softmax = rng.choice(
        [
            "torch.softmax({}, dim=-1)",
            "F.softmax({}, dim=-1)",
            "{}.softmax(-1)",
        ]
        if not upcast
        else [
            "torch.softmax({}.float(), dim=-1).to(" + v + ".dtype)",
            "F.softmax({}, dim=-1, dtype=torch.float32).type_as(" + v + ")",
        ]
    )
    notes.append("fp32 softmax" if upcast else "softmax")
    probs = w.let("probs", softmax.format(s))
    if rng.random() < 0.2:
        probs = w.let("probs", w.dropout(probs))
        notes.append("dropout")
    if style == "einsum":
        out = w.let("att", f"torch.einsum('bhqk,bhkd->bhqd', {probs}, {v})")
    elif flat:
        out = w.let("att", f"torch.bmm({probs}, {v}).view({B}, {H}, {Lq}, {D})")
    else:
        out = w.let("att", rng.choice([f"{probs} @ {v}", f"torch.matmul({probs}, {v})"]))
    w.note(f"attention({', '.join(notes)})")
    return out


def _apply_mask(rng: random.Random, s: str, mask: tuple[bool, str], fill: str) -> str:
    """`mask` is (True where kept?, expression)."""
    kept, expr = mask
    if kept:
        return rng.choice(
            [
                f"{s}.masked_fill(~{expr}, {fill})",
                f"torch.where({expr}, {s}, {fill})",
                f"{s}.masked_fill({expr}.logical_not(), {fill})",
            ]
        )
    return rng.choice([f"{s}.masked_fill({expr}, {fill})", f"torch.where({expr}, {fill}, {s})"])


def attention_block(w: Writer) -> None:
    """q, k, v as inputs, in (B, H, L, D) or (B, L, H, D) transposed to it."""
    rng = w.rng
    B, H = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
    Lq = rng.choice([1, 2, 3, 5, 7, 8, 16])
    Lk = Lq if rng.random() < 0.5 else rng.choice([1, 3, 4, 6, 9])
    D = rng.choice([2, 4, 5, 8, 16, 32])
    Hkv = H
    if H in (2, 4) and rng.random() < 0.25:
        Hkv = rng.choice([h for h in (1, 2) if h < H])
    dims = dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D)
    heads_second = rng.random() < 0.3
    qkv = []
    for name, heads, length in (("q", H, Lq), ("k", Hkv, Lk), ("v", Hkv, Lk)):
        if heads_second:
            t = w.leaf(name, [B, length, heads, D])
            qkv.append(w.let(name, f"{t}.transpose(1, 2)"))
        else:
            qkv.append(w.leaf(name, [B, heads, length, D]))
    w.note(f"B={B} H={H}/{Hkv} Lq={Lq} Lk={Lk} D={D}")
    w.output(attention(w, *qkv, dims, causal=rng.random() < 0.3))


# ---------------------------------------------------------------------------------------------
# residual + normalization


def norm(w: Writer, h: str, width: int) -> str:
    """One normalization of `h` over its last dim of `width`, in a random spelling."""
    rng = w.rng
    w.promised["norm"] += 1
    eps = rng.choice([1e-5, 1e-6, 1e-3])
    spelling = rng.choice(
        ["nn.LayerNorm", "F.layer_norm", "nn.RMSNorm", "F.rms_norm", "t5", "llama", "sqrt_div"]
    )
    affine = rng.random() < 0.8
    if spelling == "nn.LayerNorm":
        bias = rng.random() < 0.8
        mod = w.module(
            "ln", f"nn.LayerNorm({width}, eps={eps}, elementwise_affine={affine}, bias={bias})"
        )
        out = w.let("n", f"{mod}({h})")
    elif spelling == "nn.RMSNorm":
        eps_arg = rng.choice([f"eps={eps}", "eps=None"])
        mod = w.module("rms", f"nn.RMSNorm({width}, {eps_arg}, elementwise_affine={affine})")
        out = w.let("n", f"{mod}({h})")
    elif spelling == "F.layer_norm":
        weight = w.param("lnw", [width]) if affine else "None"
        bias = w.param("lnb", [width], 0.5) if affine and rng.random() < 0.8 else "None"
        out = w.let("n", f"F.layer_norm({h}, ({width},), {weight}, {bias}, eps={eps})")
    elif spelling == "F.rms_norm":
        weight = w.param("rmsw", [width]) if affine else "None"
        out = w.let("n", f"F.rms_norm({h}, [{width}], {weight}, eps={eps})")
    elif spelling == "t5":
        weight = w.param("rmsw", [width])
        var = w.let("var", f"{h}.to(torch.float32).pow(2).mean(-1, keepdim=True)")
        r = w.let("r", f"{h} * torch.rsqrt({var} + {eps})")
        if w.dtype != torch.float32:
            r = w.let("r", f"{r}.to({weight}.dtype)")
        out = w.let("n", f"{weight} * {r}")
    elif spelling == "llama":
        weight = w.param("rmsw", [width])
        h32 = w.let("h32", f"{h}.to(torch.float32)")
        var = w.let("var", f"{h32}.pow(2).mean(-1, keepdim=True)")
        h32 = w.let("h32", f"{h32} * torch.rsqrt({var} + {eps})")
        out = w.let("n", f"{weight} * {h32}.to({h}.dtype)")
    else:
        out = w.let("n", f"{h} / torch.sqrt(({h} * {h}).mean(-1, keepdim=True) + {eps})")
    w.note(f"{spelling}{'' if affine else '(no affine)'}")
    return out


def residual(w: Writer, x: str, y: str, width: int) -> str:
    """The sum a norm reads: x + y, with the branch's bias and dropout in random spellings."""
    rng = w.rng
    form = rng.choice(["plain", "plain", "commuted", "bias", "dropout", "bias_dropout"])
    if "bias" in form:
        y = f"({y} + {w.param('rb', [width], 0.5)})"
    if "dropout" in form:
        y = w.dropout(y)
    w.note(f"residual {form}")
    return w.let("sum", f"{y} + {x}" if form == "commuted" else f"{x} + {y}")


def norm_block(w: Writer) -> None:
    """LayerNorm/RMSNorm of a residual sum: plain, post-LN (linear branch), or pre-LN (the sum
    read again after the norm)."""
    rng = w.rng
    rows = rng.choice([[1], [3], [7], [2, 5], [3, 1], [2, 3, 4]])
    width = rng.choice([1, 3, 8, 16, 17, 32, 64])
    x = w.leaf("x", [*rows, width])
    kind = rng.choice(["sum", "post_ln", "pre_ln", "no_residual"])
    w.note(f"norm block {kind} rows={rows} width={width}")
    if kind == "no_residual":
        w.output(norm(w, x, width))
        return
    if kind == "post_ln":
        h = w.leaf("h", [*rows, width])
        weight = w.param("wl", [width, width], width**-0.5)
        bias = w.param("bl", [width], 0.5) if rng.random() < 0.7 else None
        y = w.let("y", f"F.linear({h}, {weight}, {bias})" if bias else f"{h} @ {weight}.t()")
    else:
        y = w.leaf("y", [*rows, width])
    s = residual(w, x, y, width)
    n = norm(w, s, width)
    if kind == "pre_ln":
        t = w.let("t", f"{s} + torch.tanh({n})")
        w.output(norm(w, t, width) if rng.random() < 0.5 else t)
    else:
        w.output(n)


# ---------------------------------------------------------------------------------------------
# pointwise regions

UNARY = [
    "F.gelu({})",
    "F.gelu({}, approximate='tanh')",
    "0.5 * {0} * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)"
    " * ({0} + 0.044715 * torch.pow({0}, 3.0))))",
    "F.silu({})",
    "torch.sigmoid({})",
    "torch.tanh({})",
    "F.relu({})",
    "torch.exp({}.clamp(max=4.0))",
    "torch.log({}.abs() + 1.0)",
    "torch.sqrt({0} * {0} + 0.5)",
    "torch.rsqrt({}.abs() + 1.0)",
    "torch.erf({})",
    "torch.sin({})",
    "torch.cos({})",
    "{}.clamp(-1.5, 2.0)",
    "torch.pow({}, 2)",
    "{} ** 3",
    "({}.abs() + 1.0) ** 0.5",
    "{} * 1.7",
    "{} / 3.0",
    "{} - 0.25",
    "torch.where({0} > 0.1, {0}, 0.5 * {0})",
    "{0}.masked_fill({0} < -1.0, 0.0)",
    "torch.minimum({}, torch.tensor(0.75))",
]  # fmt: skip
"""Element-wise ops of one operand; `{}` is the operand."""


def pointwise(w: Writer, x: str, shape: list[int]) -> tuple[str, list[int], list[str]]:
    """A chain of element-wise ops on `x`, with second operands of broadcast shapes; returns the
    result, its shape and the chain's ops."""
    rng = w.rng
    names = []
    for _ in range(rng.randint(1, 5)):
        kind = pick(rng, ("unary", 6), ("binary", 2), ("cast", 1), ("glu", 1), ("dropout", 1))
        if kind == "unary":
            op = rng.choice(UNARY)
            x = w.let("p", op.format(x))
            names.append(op.format("x"))
        elif kind == "binary":
            other_shape = rng.choice(
                [shape, shape[-1:], [*shape[:-1], 1], [], [1] * (len(shape) - 1) + shape[-1:]]
            )
            if len(shape) >= 3 and rng.random() < 0.3:
                other_shape = [shape[0], *([1] * (len(shape) - 2)), shape[-1]]
            if other_shape == []:
                other = w.input("c", "torch.tensor(1.3)")
            else:
                other = w.leaf("o", other_shape, grad=rng.random() < 0.7)
            op = rng.choice(["+", "*", "-", "max", "min", "where"])
            if op in "+*-":
                x = w.let("p", f"{x} {op} {other}")
            elif op == "where":
                x = w.let("p", f"torch.where({other} > 0, {x}, {other})")
            else:
                x = w.let("p", f"torch.{op}imum({x}, {other})")
            names.append(f"{op} {tuple(other_shape)}")
        elif kind == "cast":
            low = "torch.bfloat16" if rng.random() < 0.5 else "torch.float16"
            x = w.let("p", f"{x}.to({low}).to({x}.dtype)")
            w.rounds_to(torch.bfloat16 if "bfloat16" in low else torch.float16)
            names.append("cast")
        elif kind == "glu" and shape[-1] % 2 == 0:
            act = rng.choice(["F.silu", "F.gelu"])
            a, b = w.let("a", f"{x}.chunk(2, dim=-1)[0]"), w.let("b", f"{x}.chunk(2, dim=-1)[1]")
            x = w.let("p", f"{act}({a}) * {b}")
            shape = [*shape[:-1], shape[-1] // 2]
            names.append(f"{act}-glu")
        elif kind == "dropout":
            x = w.let("p", w.dropout(x))
            names.append("dropout")
    w.note(f"pointwise[{', '.join(names)}]")
    return x, shape, names


def pointwise_block(w: Writer) -> None:
    """A chain on an input of 1 to 4 dims; sometimes ending in a dropout that is returned."""
    rng = w.rng
    shape = rng.choice([[5], [1, 8], [3, 7], [2, 3, 4], [4, 1, 6], [2, 2, 3, 8], [16, 32]])
    x = w.leaf("x", shape)
    out, _, ops = pointwise(w, x, shape)
    if rng.random() < 0.25:
        if "dropout" not in ops:  # the eager result without dropout is then the kept values
            w.dropped.append(len(w.outputs))
        out = w.let("p", w.dropout(out))
        ops.append("dropout")
        w.note("then dropout")
    # the value comparison runs with p=0, where a dropout is no op at all
    if len([op for op in ops if op not in ("cast", "dropout")]) >= 2:
        w.promised["pointwise"] += 1
    w.output(out)


# ---------------------------------------------------------------------------------------------
# the loss


def draw_target(w: Writer, rows: list[int], vocab: int, ignore: int | None) -> str:
    """The class indices of `rows` tokens, in a random layout: contiguous, or a view of a larger
    tensor (`TARGET_VIEWS`) passed in laid out so or made in the program from that tensor.
    Always int64: int32 targets make eager raise ("expected target dtype to be Long or Byte"),
    so they make no valid program (the harness compares results, not errors), and byte targets,
    which eager takes, torch.compile refuses with any backend (Dynamo's fake `gather` takes
    int32 or int64 indices only)."""
    rng = w.rng
    n = math.prod(rows)
    layout = pick(
        rng,
        ("contiguous", 4),
        ("stepped", 1),
        ("column", 1),
        ("offset", 1),
        ("expanded", 1),
        ("shifted", 1),
    )
    drawn = f"targets(g, [{n}], {vocab}, {ignore})"
    if layout == "contiguous":
        w.kinds["target contiguous"] += 1
        return w.input("target", drawn)
    inside = layout == "shifted" or rng.random() < 0.5
    w.kinds[f"target {layout} {'made in the program' if inside else 'input'}"] += 1
    w.note(f"target {layout}{' made in the program' if inside else ''}")
    if not inside:
        return w.input("target", f"laid_out(g, {drawn}, {vocab}, {layout!r})")
    rows_arg = f", rows={rows[0] if len(rows) > 1 else 1}" if layout == "shifted" else ""
    base = w.input("tbase", f"target_storage(g, {drawn}, {vocab}, {layout!r}{rows_arg})")
    return w.let("target", TARGET_VIEWS[layout].format(base, n=n))


def loss(w: Writer, logits: str | tuple[str, str, str | None], target: str, ignore: int | None):
    """A cross-entropy of `logits` ((N, V) name, or (h, weight, bias) of a linear forming them)
    in a random spelling; records its outputs."""
    rng = w.rng
    if isinstance(logits, tuple):
        h, weight, bias = logits
        logits = w.let(
            "logits",
            rng.choice(
                [f"F.linear({h}, {weight}, {bias})"]
                if bias
                else [f"F.linear({h}, {weight})", f"{h} @ {weight}.t()", f"{h} @ {weight}.T"]
            ),
        )
    if w.dtype != torch.float32 and rng.random() < 0.5:
        logits = w.let("logits", f"{logits}.float()")
    spellings = ["F.cross_entropy", "nn.CrossEntropyLoss", "nll_loss"]
    if ignore is None or ignore >= 0:  # fairseq gathers the padding index's log-probability
        spellings.append("fairseq")
    spelling = rng.choice(spellings)
    default_ignore = ignore is None or (ignore == -100 and rng.random() < 0.5)
    ignore_arg = "" if default_ignore else f", ignore_index={ignore}"
    if spelling == "fairseq":
        # docs/loss.md describes the spelling with its masked_fill of padding and, without an
        # ignore index, with the squeeze fairseq writes instead
        w.promised["loss"] += 2
        eps = rng.choice([0.0, 0.1])
        lprobs = w.let("lprobs", f"F.log_softmax({logits}, dim=-1)")
        t = w.let("t", f"{target}.unsqueeze(-1)")
        nll = w.let("nll", f"-{lprobs}.gather(dim=-1, index={t})")
        smooth = w.let("smooth", f"-{lprobs}.sum(dim=-1, keepdim=True)")
        if ignore is not None:
            pad = w.let("pad", f"{t}.eq({ignore})")
            nll = w.let("nll", f"{nll}.masked_fill({pad}, 0.0)")
            smooth = w.let("smooth", f"{smooth}.masked_fill({pad}, 0.0)")
        else:
            nll, smooth = (
                w.let("nll", f"{nll}.squeeze(-1)"),
                w.let("smooth", f"{smooth}.squeeze(-1)"),
            )
        nll, smooth = w.let("nll", f"{nll}.sum()"), w.let("smooth", f"{smooth}.sum()")
        eps_i = w.let("eps_i", f"{eps} / ({lprobs}.size(-1) - 1)")
        w.output(w.let("loss", f"(1.0 - {eps} - {eps_i}) * {nll} + {eps_i} * {smooth}"))
        w.output(nll)
        w.note(f"fairseq label-smoothed eps={eps} ignore={ignore}")
        return
    w.promised["loss"] += 1
    reduction = rng.choice(["mean", "mean", "sum", "none"])
    red_arg = "" if reduction == "mean" else f", reduction={reduction!r}"
    if spelling == "nll_loss":
        lsm = rng.choice(
            [
                f"F.log_softmax({logits}, dim=-1)",
                f"torch.log_softmax({logits}.float(), -1)",
                f"{logits}.log_softmax(dim=-1)",
            ]
        )
        out = w.let("loss", f"F.nll_loss({lsm}, {target}{ignore_arg}{red_arg})")
        w.note(f"log_softmax+nll_loss {reduction} ignore={ignore}")
    else:
        smoothing = rng.choice([0.0, 0.0, 0.1, 0.3])
        ls_arg = f", label_smoothing={smoothing}" if smoothing else ""
        args = f"{ignore_arg}{ls_arg}{red_arg}".lstrip(", ")
        if spelling == "F.cross_entropy":
            out = w.let("loss", f"F.cross_entropy({logits}, {target}{', ' if args else ''}{args})")
        else:
            ce = w.name("ce")
            w.params.append(f"m.{ce} = nn.CrossEntropyLoss({args})")
            out = w.let("loss", f"m.{ce}({logits}, {target})")
        w.note(f"{spelling} {reduction} ignore={ignore} smoothing={smoothing}")
    w.output(out)


def loss_block(w: Writer) -> None:
    """Logits as an input ((N, V), or (B, L, V) flattened) or from a linear of hidden states."""
    rng = w.rng
    rows = rng.choice([[1], [5], [12], [13], [2, 3], [3, 7]])
    vocab = rng.choice([2, 5, 17, 64, 101])
    ignore = rng.choice([None, -100, 0, vocab - 1])
    target = draw_target(w, rows, vocab, ignore)
    source = rng.choice(["input", "input", "linear"])
    w.note(f"loss block rows={rows} V={vocab} logits from {source}")
    if source == "input":
        x = w.leaf("x", [*rows, vocab], scale=2.0)
        logits = x if len(rows) == 1 else w.let("x", f"{x}.reshape(-1, {vocab})")
        loss(w, logits, target, ignore)
        return
    width = rng.choice([3, 8, 16])
    h = w.leaf("h", [*rows, width])
    if len(rows) > 1:
        h = w.let("h", f"{h}.reshape(-1, {width})")
    weight = w.param("head", [vocab, width], width**-0.5)
    bias = w.param("hb", [vocab], 0.5) if rng.random() < 0.3 else None
    loss(w, (h, weight, bias), target, ignore)


# ---------------------------------------------------------------------------------------------
# a composed transformer layer: embedding, pre-LN or post-LN attention and MLP, LM head, loss


def layer_block(w: Writer) -> None:
    rng = w.rng
    B, L = rng.choice([1, 2]), rng.choice([1, 3, 5, 8])
    H, Dh = rng.choice([1, 2]), rng.choice([2, 4, 8])
    d, vocab = H * Dh, rng.choice([7, 16, 33])
    pre_ln = rng.random() < 0.6
    w.note(f"layer {'pre' if pre_ln else 'post'}-LN B={B} L={L} H={H} Dh={Dh} V={vocab}")
    tokens = w.input("tok", f"targets(g, [{B}, {L}], {vocab})")
    ignore = rng.choice([None, -100])
    target = draw_target(w, [B, L], vocab, ignore)
    emb = w.param("emb", [vocab, d])
    x = w.let("x", f"F.embedding({tokens}, {emb})")
    if rng.random() < 0.5:
        x = w.let("x", f"{x} + {w.param('pos', [L, d], 0.5)}")

    def attend(a: str) -> str:
        qkv = w.let("qkv", f"F.linear({a}, {w.param('wqkv', [3 * d, d], d**-0.5)})")
        heads = [
            w.let(n, f"{t}.view({B}, {L}, {H}, {Dh}).transpose(1, 2)")
            for n, t in zip(
                "qkv", [f"{qkv}[..., {i * d}:{(i + 1) * d}]" for i in range(3)], strict=True
            )
        ]
        dims = dict(B=B, H=H, Hkv=H, Lq=L, Lk=L, D=Dh)
        o = attention(w, *heads, dims, causal=rng.random() < 0.7)
        o = w.let("o", f"{o}.transpose(1, 2).reshape({B}, {L}, {d})")
        return w.let("o", f"F.linear({o}, {w.param('wo', [d, d], d**-0.5)})")

    def mlp(a: str) -> str:
        weight, bias = w.param("wu", [4 * d, d], d**-0.5), w.param("bu", [4 * d], 0.5)
        up = w.let("up", f"F.linear({a}, {weight}, {bias})")
        act, shape, _ = pointwise(w, up, [B, L, 4 * d])
        width = shape[-1]
        return w.let("down", f"F.linear({act}, {w.param('wd', [d, width], width**-0.5)})")

    if pre_ln:
        x = w.let("x", f"{x} + {w.dropout(attend(norm(w, x, d)))}")
        x = w.let("x", f"{x} + {w.dropout(mlp(norm(w, x, d)))}")
        x = norm(w, x, d)
    else:
        x = norm(w, w.let("x", f"{x} + {w.dropout(attend(x))}"), d)
        x = norm(w, w.let("x", f"{x} + {w.dropout(mlp(x))}"), d)
    h = w.let("h", f"{x}.reshape(-1, {d})")
    tied = rng.random() < 0.5
    head = emb if tied else w.param("head", [vocab, d], d**-0.5)
    loss(w, (h, head, None), target, ignore)
    w.note("tied head" if tied else "head")


BLOCKS = [
    (attention_block, 4),
    (norm_block, 3),
    (pointwise_block, 3),
    (loss_block, 3),
    (layer_block, 2),
]


def generate(seed: int, only: tuple[int, ...] | None = None) -> Program:
    """The program of `seed`: two to five independent blocks in one dtype. Each block draws from
    a generator of its own, so `only` (block indices) makes a smaller program whose blocks are
    spelled as in the whole one."""
    rng = random.Random(seed)
    dtype = pick(rng, (torch.float32, 8), (torch.bfloat16, 1), (torch.float16, 1))
    kinds = rng.choices(*zip(*BLOCKS, strict=True), k=rng.randint(2, 5))
    dropout = rng.choice([0.0, 0.0, 0.0, 0.1, 0.3, 0.5])
    project_inside = rng.random() < 0.5
    w = Writer(rng, dtype)
    parts = []
    for i, block in enumerate(kinds):
        if only is None or i in only:
            w.rng, start = random.Random(f"{seed}/{i}"), len(w.notes)
            block(w)
            parts.append(f"[{i}] " + ", ".join(w.notes[start:]))
    params = "\n    ".join(["m = nn.Module()", *w.params, "return m"])
    inputs = "".join(f"\n        {expr},  # {name}" for name, expr in w.inputs)
    body = "\n    ".join([*w.body, f"return ({', '.join(w.outputs)},)"])
    source = (
        f"def build(g):\n    {params}\n\n\n"
        f"def inputs(g):\n    return [{inputs}\n    ]\n\n\n"
        f"def program(m, {', '.join(name for name, _ in w.inputs)}):\n    {body}\n"
    )
    name = f"seed={seed}" + ("" if only is None else f" only={list(only)}")
    return Program(
        seed=seed,
        name=name,
        summary=f"{name} {str(dtype).removeprefix('torch.')}: " + "; ".join(parts),
        source=source,
        dtype=dtype,
        tolerance=w.tolerance,
        promised=w.promised,
        dropout=dropout if w.dropouts else 0.0,
        dropped_outputs=tuple(w.dropped),
        project_inside=project_inside,
        blocks=len(parts),
        kinds=w.kinds,
    )
