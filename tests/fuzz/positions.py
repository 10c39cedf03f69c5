"""Masks and biases the fuzzer's attention blocks compute from query and key positions: aranges
composed with comparisons, triangles, casts, products, fills, negations, `&`/`|` and in-place
edits, and biases of key - query (ALiBi slopes, bucketed distances). Each line runs while it is
drawn, so the generator knows every value: many masks are not what they look like (a boolean
triangle filled with -inf holds True), and only those that leave every query a key are kept."""

from __future__ import annotations

import dataclasses
import random
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

VISIBLE_ABOVE = -1e3
"""A score whose mask or bias adds at most this is taken as hidden when the generator checks that
every query keeps a key. docs/attention.md ("Rows in which every key is
masked"): a row whose every key is masked differs from eager by design where the kernel computes
the causal triangle, window or documents (a finite fill is read as -inf there), and eager's
softmax of a row of -inf is NaN where the kernel's is 0; so no mask drawn here hides every key of
a row, counting a key as hidden well above the -1e4 the attention reader takes as a fill."""

MASK_FILLS = ["float('-inf')", "torch.finfo({}).min", "-1e4", "-1e9"]
"""What a mask fills where it hides a score; one per mask, so its fills read as one (the kernel
fills one value: "masks fill different values" is a refusal)."""
SMALL_FILLS = ["-3.0", "5.0"]
"""Fills that shift a score instead of hiding it."""

TRIES = 12


class Invalid(Exception):
    """The drawn code raises, or gives a value the generator does not use (NaN, a float cast to
    an integer out of its range); the draw is tried again."""


@dataclasses.dataclass
class Application:
    """How a site applies the position terms: `sdpa` (the `attn_mask` expression) or `written`
    (a function of the scores' name giving their next expression, latest last)."""

    notes: list[str]
    sdpa: str | None = None
    written: list[Callable[[str], str]] = dataclasses.field(default_factory=list)


class Builder:
    """Draws one site's position terms. Lines run at once in a namespace of their own (the
    helpers, `m` holding the parameters drawn, the inputs drawn as the program will make them);
    nothing reaches the program until `commit`."""

    def __init__(self, w: Any, dims: dict[str, int], rank: int, q: str, namespace: dict):
        self.w, self.rng = w, w.rng
        self.B, self.H, self.Lq, self.Lk = dims["B"], dims["H"], dims["Lq"], dims["Lk"]
        self.rank = rank
        """4: the scores are (B, H, Lq, Lk); 2: heads flattened into the batch, so the terms
        are (Lq, Lk) at most."""
        self.scores = [self.B, self.H, self.Lq, self.Lk] if rank == 4 else [self.Lq, self.Lk]
        self.q = q
        self.env = dict(namespace)
        self.env["m"] = types.SimpleNamespace()
        self.env[q] = torch.empty(0, dtype=w.dtype)  # its device and dtype are read
        self.lines: list[str] = []
        self.params: list[str] = []
        self.inputs: list[tuple[str, str]] = []
        self.kinds: Counter[str] = Counter()
        fill = self.rng.choice(MASK_FILLS)
        self.fill = fill
        """The mask's fill, a format string for the filled tensor's dtype."""
        self.small = self.rng.choice(SMALL_FILLS)
        self.natural: tuple[str, ...] = ()
        """How a canonical mask is meant to be applied ("keep", "hide", "add")."""

    # -- running code as it is drawn

    def run(self, line: str) -> None:
        try:
            exec(line, self.env)
        except Exception as error:
            raise Invalid(f"{line}: {error}") from None
        self.lines.append(line)

    def let(self, prefix: str, expr: str) -> str:
        name = self.w.name(prefix)
        self.run(f"{name} = {expr}")
        value = self.env[name]
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.isnan().any():
            raise Invalid(f"{expr} holds NaN")
        return name

    def value(self, name: str) -> torch.Tensor:
        return self.env[name]

    def param(self, prefix: str, shape: list[int], scale: float) -> str:
        name = self.w.name(prefix)
        self.params.append(f"m.{name} = nn.Parameter(leaf(g, {shape}, {self.w.dt}, scale={scale}))")
        drawn = torch.randn(shape, generator=torch.Generator().manual_seed(len(self.params)))
        value = (drawn * scale).to(self.w.dtype)  # (torch's own generator stays as it was)
        setattr(self.env["m"], name, value)
        return f"m.{name}"

    def input(self, prefix: str, expr: str) -> str:
        name = self.w.name(prefix)
        self.inputs.append((name, expr))
        self.env[name] = eval(expr, self.env)
        return name

    def kind(self, *names: str) -> None:
        self.kinds.update(names)

    def filled(self, fill: str) -> str:
        """`fill`, counted among the kinds by its value."""
        name = "finfo.min" if "finfo" in fill else fill.replace("float('-inf')", "-inf")
        self.kind(f"fill {name}")
        return fill

    def commit(self) -> None:
        w = self.w
        w.params += self.params
        w.inputs += self.inputs
        w.body += self.lines
        w.kinds.update(self.kinds)

    # -- what a site sees

    def visible(self, value: torch.Tensor, how: str, fill: str | None = None) -> torch.Tensor:
        """Where the scores stay visible when `value` is applied `how`: "keep" (a boolean mask
        keeping where True, the scores filled with `fill` elsewhere), "hide" (filled where True)
        or "add" (added, cast to the scores' dtype)."""
        if how == "add":
            added = value.to(self.w.dtype)
            if added.isnan().any() or (added == float("inf")).any():
                raise Invalid("adds NaN or +inf")
            return added > VISIBLE_ABOVE
        if not self.hides(fill):
            return torch.ones_like(value)
        return value if how == "keep" else ~value

    def hides(self, fill: str | None) -> bool:
        """Whether `fill` (an expression; None: SDPA's boolean mask) on the scores hides them."""
        if fill is None:
            return True
        filled = eval(fill, self.env)
        return float(torch.tensor(filled, dtype=torch.float64).to(self.w.dtype)) <= VISIBLE_ABOVE

    def every_row_keeps(self, visible: torch.Tensor) -> bool:
        try:
            shape = torch.broadcast_shapes(visible.shape, self.scores)
        except RuntimeError:
            return False
        return list(shape) == self.scores and bool(visible.expand(shape).any(-1).all())

    def rows_keeping_two(self, visible: torch.Tensor) -> float:
        """The share of rows that keep two keys or more. A row of one key has a bias gradient of
        exactly 0 in eager (softmax's backward cancels) and of rounding in a flash-style backward
        (its row delta is rowsum(dO * O)); a learned slope or table sums that over rows and
        distances, so where most rows keep one key (Lk = 1, a diagonal), its gradient is
        rounding against eager's 0 and fails a tolerance scaled by that 0 (the slow tier found
        it, Lk = 1). Sites with a learned bias keep two keys in most rows."""
        shape = torch.broadcast_shapes(visible.shape, self.scores)
        return (visible.expand(shape).sum(-1) >= 2).float().mean().item()

    def fits(self, value: torch.Tensor) -> bool:
        """Broadcasts to the scores without enlarging them."""
        try:
            return list(torch.broadcast_shapes(value.shape, self.scores)) == self.scores
        except RuntimeError:
            return False

    def fill_for(self, dtype: torch.dtype) -> str:
        return self.fill.format(dtype)


def pick(rng: random.Random, *weighted: tuple[Any, float]) -> Any:
    values, weights = zip(*weighted, strict=True)
    return rng.choices(values, weights)[0]


# ---------------------------------------------------------------------------------------------
# positions

TWISTS = {
    "cast to int8": "({} + 120).to(torch.int8)",  # wraps past 127
    "halved": "({} * 0.5).long()",
    "floor-divided": "{} // {c}",
    "as float": "{}.float()",
    "modulo": "{} % {c}",
    "flipped": "{}.flip(0)",
    "clamped": "{}.clamp(max={c})",
}
"""What the positions may go through before they are compared: most leave them positions no
more, so the mask looks like one the reader knows and is not."""


def positions(b: Builder, plain: bool = False) -> tuple[str, str]:
    """Query and key positions, broadcast along the scores' last two dims: aranges of int64 or
    int32, on q's device or not, sliced from a longer one, offset, the queries at the end of the
    keys (a cache), restarted in place (packed rows), and then through an op that keeps them
    positions or not (`TWISTS`); `plain` ones mostly as models write them."""
    rng = b.rng
    odd = 0.3 if plain else 1.0  # how often the unusual spellings come
    shared = {
        "dtype": rng.random() < 0.25 * odd,
        "device": rng.random() < 0.25,
        "offset": rng.choice([1, 3, 8]) if rng.random() < 0.2 * odd else 0,
        "twist": rng.choice(list(TWISTS)) if rng.random() < 0.2 else None,
    }
    four = b.rank == 4 and rng.random() < 0.5
    made = []
    for axis, length in (("q", b.Lq), ("kv", b.Lk)):
        same = rng.random() < 1 - 0.2 * odd  # mostly alike, sometimes not (another diagonal)
        options = shared if same else {**{k: not v for k, v in shared.items()}, "offset": 0}
        if not same:
            options["twist"] = None if shared["twist"] else rng.choice(list(TWISTS))
        kw = ""
        if options["dtype"]:
            kw += ", dtype=torch.int32"
            b.kind("arange int32")
        if options["device"]:
            kw += f", device={b.q}.device"
            b.kind("arange device=")
        form = pick(rng, ("plain", 5), ("sliced", 2 * odd), ("end", 2 if axis == "q" else 0))
        offset = options["offset"]
        if form == "end" and b.Lk >= b.Lq:
            expr = f"torch.arange({b.Lk - b.Lq + offset}, {b.Lk + offset}{kw})"
            b.kind("arange at the end of the keys")
        elif form == "sliced":
            extra = rng.choice([1, 5, 64])
            start = rng.choice([0, extra])
            expr = f"torch.arange({length + extra}{kw})[{start}:{start + length}]"
            shift = offset - start
            if shift:
                expr = f"({expr} {'+' if shift > 0 else '-'} {abs(shift)})"
            b.kind("arange sliced")
        elif offset:
            expr = rng.choice(
                [
                    f"torch.arange({offset}, {length + offset}{kw})",
                    f"torch.arange({length}{kw}) + {offset}",
                ]
            )
            b.kind("arange offset")
        else:
            expr = f"torch.arange({length}{kw})"
        p = b.let("qpos" if axis == "q" else "kpos", expr)
        if rng.random() < 0.12 * odd and length > 2:
            j = rng.randint(1, length - 1)
            b.run(f"{p}[{j}:] -= {j}")  # positions restart: another sequence packed in the row
            b.kind("in-place positions")
        if options["twist"]:
            p = b.let("pos", TWISTS[options["twist"]].format(p, c=rng.randint(2, 4)))
            b.kind(f"positions {options['twist']}")
        if axis == "q":
            forms = (
                [f"{p}[None, None, :, None]", f"{p}.view(1, 1, -1, 1)"]
                if four
                else [f"{p}[:, None]", f"{p}.unsqueeze(-1)", f"{p}.view(-1, 1)"]
            )
        else:
            forms = (
                [f"{p}[None, None, None, :]", f"{p}.view(1, 1, 1, -1)"]
                if four
                else [f"{p}[None, :]", f"{p}.unsqueeze(0)", p]
            )
        made.append(b.let("q_idx" if axis == "q" else "kv_idx", rng.choice(forms)))
    return made[0], made[1]


# ---------------------------------------------------------------------------------------------
# boolean masks

COMPARISONS = [("<=", 2), ("<", 2), (">=", 2), (">", 2), ("==", 2), ("!=", 2)]
MIRROR = {"<=": ">=", "<": ">", ">=": "<=", ">": "<", "==": "==", "!=": "!="}
NAMED = {"<=": "le", "<": "lt", ">=": "ge", ">": "gt", "==": "eq", "!=": "ne"}


def _compare(b: Builder, lhs: str, op: str, rhs: str) -> str:
    """`lhs op rhs` in one of its spellings: either operand order, or torch's function."""
    rng = b.rng
    b.kind(f"compare {op}")
    form = pick(rng, ("infix", 4), ("swapped", 2), ("function", 1))
    if form == "swapped":
        b.kind("compare swapped")
        return f"{rhs} {MIRROR[op]} {lhs}"
    if form == "function" and not lhs.lstrip("-").isdigit():
        return f"torch.{NAMED[op]}({lhs}, {rhs})"
    return f"{lhs} {op} {rhs}"


def comparison(b: Builder, q: str, kv: str) -> str:
    """A comparison of the positions with each other, their difference, or a constant."""
    rng = b.rng
    op = pick(rng, *COMPARISONS)
    form = pick(rng, ("kv q", 4), ("difference", 2), ("shifted", 1), ("constant", 2))
    w = rng.randint(1, max(1, b.Lk))
    if form == "kv q":
        lhs, rhs = kv, q
    elif form == "difference":
        lhs, rhs = rng.choice([(f"({q} - {kv})", str(w)), (f"({kv} - {q})", str(-w + 1))])
        b.kind("compare difference")
    elif form == "shifted":
        lhs, rhs = f"{kv} + {rng.randint(0, 3)}", f"{q} + {rng.randint(0, 3)}"
        b.kind("compare shifted")
    else:
        lhs, rhs = rng.choice([kv, q]), str(rng.randint(0, max(b.Lq, b.Lk)))
        b.kind("compare constant")
    return b.let("cmp", _compare(b, lhs, op, rhs))


def causal(b: Builder, q: str, kv: str) -> str:
    """Keeps kv <= q, spelled many ways."""
    rng = b.rng
    b.kind("causal")
    spell = rng.choice(
        [
            lambda: _compare(b, kv, "<=", q),
            lambda: f"({kv} - {q}) <= 0",
            lambda: f"({q} - {kv}) >= 0",
            lambda: f"~({kv} > {q})",
            lambda: f"({kv} < {q} + 1)",
        ]
    )
    return b.let("causal", spell())


def window(b: Builder, q: str, kv: str) -> str:
    """A sliding window of w keys, with the causal half-plane or alone."""
    rng = b.rng
    w = rng.randint(1, max(1, b.Lk))
    b.kind("window")
    spell = rng.choice(
        [
            lambda: _compare(b, f"({q} - {kv})", "<", str(w)),
            lambda: _compare(b, kv, ">", f"{q} - {w}"),
            lambda: f"({kv} - {q}).abs() < {w}",
        ]
    )
    near = b.let("near", spell())
    if rng.random() < 0.8:
        c = causal(b, q, kv)
        return b.let("window", rng.choice([f"{c} & {near}", f"{near} & {c}"]))
    return near


def prefix(b: Builder, q: str, kv: str) -> str:
    """A prefix LM's mask: causal, or a key before P (a constant, or a length per row that is a
    graph input)."""
    rng = b.rng
    if b.rank == 4 and rng.random() < 0.5:
        lengths = [rng.randint(0, b.Lk) for _ in range(b.B)]
        length = b.input("plen", f"torch.tensor({lengths})")
        length = b.let("plen", f"{length}.view({b.B}, 1, 1, 1)")
        b.kind("prefix per row")
    else:
        length = str(rng.randint(0, b.Lk))
        b.kind("prefix constant")
    before = b.let("before", _compare(b, kv, "<", length))
    c = causal(b, q, kv)
    return b.let("prefix", rng.choice([f"{c} | {before}", f"{before} | {c}"]))


def padding(b: Builder) -> str:
    """Keys before a length per row (a graph input), (B, 1, 1, Lk)."""
    lengths = [b.rng.randint(1, b.Lk) for _ in range(b.B)]
    length = b.input("lens", f"torch.tensor({lengths})")
    b.kind("padding")
    return b.let(
        "pad", f"torch.arange({b.Lk})[None, None, None, :] < {length}.view({b.B}, 1, 1, 1)"
    )


def triangle(b: Builder) -> str:
    """`tril`/`triu` of ones with a diagonal, a band, or the top left of a bigger triangle, in
    float, bool or an integer dtype, or a triangle of a fill (`nn.Transformer`'s
    `triu(full(-inf), 1)`)."""
    rng = b.rng
    dtype = pick(
        rng,
        ("", 3),
        (", dtype=torch.bool", 2),
        (", dtype=torch.long", 1),
        (", dtype=torch.int8", 1),
    )
    d = pick(rng, (0, 4), (-1, 1), (1, 2), (b.Lk - b.Lq, 1))
    form = pick(rng, ("tril", 3), ("triu", 2), ("band", 2), ("top left", 2), ("of a fill", 2))
    ones = f"torch.ones({b.Lq}, {b.Lk}{dtype})"
    b.kind(f"triangle {form}")
    if form == "tril":
        expr = rng.choice([f"torch.tril({ones}, diagonal={d})", f"{ones}.tril({d})"])
    elif form == "triu":
        expr = rng.choice([f"torch.triu({ones}, diagonal={d})", f"{ones}.triu({d})"])
    elif form == "band":
        w = rng.randint(1, max(1, b.Lk))
        expr = f"{ones}.tril().triu({1 - w})"
    elif form == "of a fill":
        fill = b.filled(rng.choice([b.fill_for("torch.float32")] * 2 + [b.small]))
        full = f"torch.full(({b.Lq}, {b.Lk}), {fill})"
        tri = rng.choice(["triu", "tril"])
        expr = rng.choice([f"torch.{tri}({full}, diagonal={d})", f"{full}.{tri}({d})"])
    else:
        n = max(b.Lq, b.Lk) + rng.choice([0, 3, 32])
        tri = rng.choice(["tril", "triu"])
        expr = f"torch.{tri}(torch.ones({n}, {n}{dtype}), diagonal={d})[:{b.Lq}, :{b.Lk}]"
    t = b.let("tri", expr)
    if b.rank == 4 and rng.random() < 0.3:
        t = b.let("tri", rng.choice([f"{t}[None, None]", f"{t}.view(1, 1, {b.Lq}, {b.Lk})"]))
    return t


def boolean(b: Builder, depth: int = 0) -> str:
    """A mask: a comparison, causal, a window, a prefix LM's, a triangle made boolean, and `&`,
    `|` or negations of them."""
    rng = b.rng
    kind = pick(
        rng,
        ("comparison", 6),
        ("causal", 2),
        ("window", 2),
        ("prefix", 2),
        ("triangle", 2),
        ("combined", 3 if depth < 1 else 0),
        ("negated", 2 if depth < 2 else 0),
    )
    if kind == "triangle":
        t = triangle(b)
        if b.value(t).dtype == torch.bool:
            return t
        b.kind("cast to bool")
        return b.let(
            "m", rng.choice([f"{t}.bool()", f"{t} != 0", f"{t} > 0", f"{t}.to(torch.bool)"])
        )
    if kind == "combined":
        x, y = boolean(b, depth + 1), boolean(b, depth + 1)
        op = rng.choice(["&", "|"])
        b.kind(f"mask {op}")
        expr = rng.choice(
            [f"{x} {op} {y}", f"torch.logical_{'and' if op == '&' else 'or'}({x}, {y})"]
        )
        return b.let("m", expr)
    if kind == "negated":
        return negated(b, boolean(b, depth + 1))
    q, kv = positions(b)
    return {"comparison": comparison, "causal": causal, "window": window, "prefix": prefix}[kind](
        b, q, kv
    )


def negated(b: Builder, m: str) -> str:
    form = b.rng.choice(["~", "== 0", "logical_not", "torch.logical_not"])
    b.kind(f"negated {form}")
    return b.let(
        "m",
        {
            "~": f"~{m}",
            "== 0": f"{m} == 0",
            "logical_not": f"{m}.logical_not()",
            "torch.logical_not": f"torch.logical_not({m})",
        }[form],
    )


# ---------------------------------------------------------------------------------------------
# what a mask goes through: casts, products, fills, negations, in-place edits


def _int_range(dtype: torch.dtype) -> tuple[float, float]:
    info = torch.iinfo(dtype)
    return float(info.min), float(info.max)


def transform(b: Builder, x: str) -> str:
    """One step on `x` that suits its dtype; `Invalid` where it raises or leaves a value the
    generator does not use."""
    rng = b.rng
    v = b.value(x)
    if v.dtype == torch.bool:
        step = pick(
            rng,
            ("cast", 5),
            ("negate", 3),
            ("fill", 2),
            ("where", 2),
            ("combine", 2),
            ("set in place", 2),
            ("zeroed", 1),
            ("one minus", 1),
        )
        if step == "zeroed":
            return _zeroed(b, x)
        if step == "one minus":  # BERT's extended attention mask
            fill = b.filled(rng.choice(["-1e4", "-1e9", "torch.finfo(torch.float32).min"]))
            b.kind("(1 - m) * fill")
            return b.let("m", f"(1.0 - {x}.float()) * {fill}")
        if step == "cast":
            return _cast(b, x, ["to(torch.int8)", "float()", "long()", "int()", "dt"])
        if step == "negate":
            return negated(b, x)
        if step == "fill":
            other = boolean(b, 1)
            fill = b.filled(rng.choice([b.fill_for("torch.float32"), b.small]))
            b.kind("fill into bool")  # the fill is True where it is not 0
            return b.let("m", f"{x}.masked_fill({other}, {fill})")
        if step == "where":
            fill = b.filled(rng.choice([b.fill_for("torch.float32")] * 2 + [b.small]))
            b.kind("where(m, 0, fill)")
            return b.let(
                "m",
                rng.choice([f"torch.where({x}, 0.0, {fill})", f"torch.where({x}, {fill}, 0.0)"]),
            )
        if step == "combine":
            op = rng.choice(["&", "|"])
            b.kind(f"mask {op}")
            return b.let("m", f"{x} {op} {boolean(b, 1)}")
        k = rng.randint(1, 3)
        value = rng.choice(["True", "False"])
        b.run(rng.choice([f"{x}[..., :{k}] = {value}", f"{x}[..., {k}:, :] = {value}"]))
        b.kind("set in place")
        return x
    if not v.is_floating_point():  # an integer tensor
        step = pick(rng, ("to bool", 3), ("product", 2), ("cast", 2), ("fill", 2), ("zeroed", 1))
        if step == "zeroed":
            return _zeroed(b, x)
        if step == "to bool":
            b.kind("cast to bool")
            return b.let("m", rng.choice([f"{x}.bool()", f"{x} != 0", f"{x} == 0", f"{x} > 0"]))
        if step == "product":
            c = rng.choice(["0.5", "2", "-1", "1e-3", "3.0"])
            b.kind("product")
            return b.let("m", f"{x} * {c}")
        if step == "cast":
            return _cast(b, x, ["float()", "to(torch.int8)", "long()", "int()", "dt"])
        low, high = _int_range(v.dtype)
        fill = b.filled(
            rng.choice([f for f in ("-1e4", "-1e9", b.small) if low <= float(f) <= high])
        )
        b.kind("fill into int")
        return b.let("m", f"{x}.masked_fill({boolean(b, 1)}, {fill})")
    step = pick(
        rng,
        ("to bool", 3),
        ("to int", 2),
        ("product", 2),
        ("fill", 2),
        ("in place", 3),
        ("cast", 2),
    )
    if step == "to bool":
        b.kind("cast to bool")
        return b.let("m", rng.choice([f"{x}.bool()", f"{x} == 0", f"{x} < 0", f"{x} != 0"]))
    if step == "to int":
        finite = v[v.isfinite()]
        if not v.isfinite().all() or (finite.abs() >= 2**31).any():
            raise Invalid("a float cast to an integer out of its range")  # C++ leaves it undefined
        small = (v.abs() < 128).all()
        return _cast(b, x, ["long()", "int()", *(["to(torch.int8)"] if small else [])])
    if step == "product":
        c = rng.choice(["0.5", "2.0", "-1.0", "1e-3"])
        b.kind("product")
        return b.let("m", f"{x} * {c}")
    if step == "fill":
        fill = b.filled(rng.choice([b.fill_for(v.dtype), b.small]))
        b.kind("fill into float")
        return b.let("m", f"{x}.masked_fill({boolean(b, 1)}, {fill})")
    if step == "cast":
        return _cast(b, x, ["dt"])
    if v.dim() < 2:
        raise Invalid("triu_ of fewer than two dims")
    b.run(f"{x}.{rng.choice(['triu_', 'tril_'])}({rng.choice([0, 1, -1])})")
    b.kind("triu_/tril_ in place")
    return x


def _cast(b: Builder, x: str, casts: list[str]) -> str:
    """`x` cast to one of `casts` ("dt": the scores' dtype)."""
    to = b.rng.choice(casts)
    if to == "dt":
        b.kind("cast to the scores' dtype")
        return b.let("m", f"{x}.to({b.q}.dtype)")
    b.kind(f"cast to {to.removeprefix('to(torch.').strip('()')}")
    return b.let("m", f"{x}.{to}")


def _zeroed(b: Builder, x: str) -> str:
    """A product an integer cast takes to 0 where `x` is 1 (a boolean mask made 0 everywhere)."""
    b.kind("product zeroed by a cast")
    return b.let("m", b.rng.choice([f"({x} * 0.5).long()", f"({x} * 0.25).to(torch.int8)"]))


def canonical(b: Builder) -> str:
    """A mask as models write it, which the attention reader means to read (causal, a window, a
    prefix LM's, padding, a triangle, a triangle of a fill, Hugging Face's and BERT's additive
    masks); sets how it is meant to be applied."""
    rng = b.rng
    four = b.rank == 4
    form = pick(
        rng,
        ("causal", 3),
        ("window", 2),
        ("prefix", 2),
        ("padded causal", 2 if four else 0),
        ("tril", 2),
        ("nanoGPT", 1 if four else 0),
        ("triu hides", 1),
        ("band", 1),
        ("nn.Transformer", 2),
        ("Hugging Face", 2),
        ("BERT", 1),
    )
    b.kind(f"canonical {form}")
    b.natural = ("keep",)
    Lq, Lk, dt = b.Lq, b.Lk, f"{b.q}.dtype"
    if form in ("tril", "triu hides", "band", "nanoGPT", "nn.Transformer"):
        dtype = rng.choice(["", ", dtype=torch.bool"])
        if form == "tril":
            x = b.let("tri", f"torch.tril(torch.ones({Lq}, {Lk}{dtype}))")
        elif form == "triu hides":
            x = b.let("tri", f"torch.triu(torch.ones({Lq}, {Lk}{dtype}), diagonal=1)")
            b.natural = ("hide",)
        elif form == "band":
            w = rng.randint(1, max(1, Lk))
            x = b.let("band", f"torch.ones({Lq}, {Lk}{dtype}).tril().triu({1 - w})")
        elif form == "nanoGPT":
            n = max(Lq, Lk) + rng.choice([0, 5])
            buffer = b.let("tri", f"torch.tril(torch.ones({n}, {n})).view(1, 1, {n}, {n})")
            x = b.let("tri", f"{buffer}[:, :, :{Lq}, :{Lk}]")
            b.natural = ("hide", "keep")  # masked_fill(tri == 0, fill)
        else:
            fill = b.filled(b.fill_for("torch.float32"))
            x = b.let("tri", f"torch.triu(torch.full(({Lq}, {Lk}), {fill}), diagonal=1)")
            b.natural = ("add",)
        if not dtype and form != "nn.Transformer":
            b.natural = ("hide", "keep")
        return x
    q, kv = positions(b, plain=True)
    if form == "window":
        return window(b, q, kv)
    if form == "prefix":
        return prefix(b, q, kv)
    x = causal(b, q, kv)
    if form == "padded causal":
        pad = padding(b)
        x = b.let("m", rng.choice([f"{x} & {pad}", f"{pad} & {x}"]))
    elif form == "Hugging Face":
        fill = b.filled(b.fill_for(dt))
        x = b.let(
            "m",
            rng.choice(
                [
                    f"torch.where({x}, 0.0, {fill}).to({dt})",
                    f"torch.zeros({Lq}, {Lk}, dtype={dt}).masked_fill(~{x}, {fill})",
                ]
            ),
        )
        b.natural = ("add",)
    elif form == "BERT":
        fill = b.filled(rng.choice(["-1e4", "torch.finfo(torch.float32).min"]))
        x = b.let("m", f"(1.0 - {x}.float()) * {fill}")
        b.natural = ("add",)
    return x


def mask(b: Builder) -> str:
    """A mask and what it goes through: a tensor of any dtype. Half are masks as models write
    them, as they are or with one step more."""
    rng = b.rng
    if rng.random() < 0.5:
        x = canonical(b)
        steps = pick(rng, (0, 2), (1, 3))
    else:
        x = triangle(b) if rng.random() < 0.3 else boolean(b)
        steps = pick(rng, (1, 3), (2, 3), (3, 2))
    if b.value(x).dtype == torch.bool and rng.random() < 0.3:  # a mask of what to hide
        x = negated(b, x)
        flip = {"keep": "hide", "hide": "keep", "add": "add"}
        b.natural = tuple(flip[how] for how in b.natural)
    for _ in range(steps):
        x = transform(b, x)
    if b.rank == 4 and b.value(x).dtype == torch.bool and rng.random() < 0.25:
        pad = padding(b)
        x = b.let("m", rng.choice([f"{x} & {pad}", f"{pad} & {x}"]))
    return x


# ---------------------------------------------------------------------------------------------
# biases of key - query


def relative(b: Builder, masked: bool) -> str:
    """A bias of key - query: its distance through abs, clamp and a cast, times slopes per head
    (ALiBi: learned, or 2 ** -h made in the graph), or a table's value at a bucket of it; where
    `masked`, sometimes filled above the diagonal."""
    rng = b.rng
    q, kv = positions(b, plain=rng.random() < 0.7)
    rel = b.let("rel", rng.choice([f"{kv} - {q}", f"{q} - {kv}"]))
    form = pick(rng, ("slopes", 3), ("buckets", 2))
    heads = b.rank == 4
    if form == "slopes":
        d = rel
        for step in rng.sample(["abs", "clamp", "negate"], rng.randint(0, 3)):
            b.kind(f"relative {step}")
            c = rng.randint(1, 6)
            d = b.let(
                "d",
                {
                    "abs": rng.choice([f"{d}.abs()", f"torch.abs({d})"]),
                    "clamp": rng.choice(
                        [
                            f"{d}.clamp(-{c}, {c})",
                            f"torch.clamp({d}, max={c})",
                            f"{d}.clamp(min=-{c})",
                        ]
                    ),
                    "negate": f"-{d}",
                }[step],
            )
        d = b.let(
            "d", rng.choice([f"{d}.float()", f"{d}.to(torch.float32)", f"{d}.to({b.q}.dtype)"])
        )
        if heads and rng.random() < 0.3:
            slopes = b.let("slopes", f"2.0 ** -torch.arange(1, {b.H + 1}).float()")
            b.kind("relative slopes made in the graph")
        else:
            slopes = b.param("slopes", [b.H] if heads else [1], 0.5)
            b.kind("relative learned slopes")
        shape = rng.choice(["1, -1, 1, 1", f"{b.H}, 1, 1"]) if heads else "1, 1"
        out = b.let(
            "alibi", rng.choice([f"{slopes}.view({shape}) * {d}", f"{d} * {slopes}.view({shape})"])
        )
    else:
        n = rng.choice([4, 8])
        b.kind("relative buckets")
        if rng.random() < 0.5:
            bucket = b.let("bucket", f"{rel}.clamp({-(n // 2)}, {n // 2 - 1}) + {n // 2}")
        else:  # T5's: exact near, logarithmic far
            a = b.let("dist", f"{rel}.abs()")
            far = b.let(
                "far",
                f"{n // 2} + (torch.log({a}.float().clamp(min=1) / {n // 2}) / math.log(4)"
                f" * {n // 2}).long()",
            )
            bucket = b.let(
                "bucket", f"torch.where({a} < {n // 2}, {a}, {far}).clamp(max={n - 1}).long()"
            )
            b.kind("relative log buckets")
        if b.value(bucket).dim() != 2:  # 4-D positions: the table's heads go last
            bucket = b.let("bucket", f"{bucket}.view({b.Lq}, {b.Lk})")
        if heads:
            table = b.param("table", [n, b.H], 0.5)
            emb = b.let(
                "emb", rng.choice([f"F.embedding({bucket}, {table})", f"{table}[{bucket}]"])
            )
            out = b.let("rbias", f"{emb}.permute(2, 0, 1).unsqueeze(0)")
        else:
            table = b.param("table", [n], 0.5)
            out = b.let("rbias", f"{table}[{bucket}]")
    if masked and rng.random() < 0.3:
        b.kind("relative masked causal")
        out = b.let(
            "rbias", f"{out}.masked_fill({kv} > {q}, {b.filled(b.fill_for(b.value(out).dtype))})"
        )
    return out


# ---------------------------------------------------------------------------------------------
# a site's terms and how they are applied


@dataclasses.dataclass
class Choice:
    """One way a site applies mask `x`: `apply` is an `attn_mask` expression (SDPA) or a
    function of the scores' name (written attention); `visible` where the scores stay visible."""

    kind: str | None
    apply: Any
    how: str
    """"keep" (hides where the mask is False), "hide" (where True) or "add"."""
    visible: torch.Tensor
    fill: str | None = None


def _applications(b: Builder, x: str, sdpa: bool) -> list[Choice]:
    """The ways the site may apply mask `x` that leave no NaN or +inf in the scores."""
    v = b.value(x)
    dt = f"{b.q}.dtype"
    out: list[Choice] = []

    def add(kind: str, apply: Any, how: str, value: torch.Tensor, fill: str | None = None) -> None:
        try:
            out.append(Choice(kind, apply, how, b.visible(value, how, fill), fill))
        except Invalid:
            pass

    if v.dtype == torch.bool:
        if sdpa:
            add("sdpa bool mask", x, "keep", v)
            add("sdpa bool mask", f"~{x}", "hide", v)
            for fill in (b.fill_for(dt), b.small):
                where = f"torch.where({x}, 0.0, {fill}).to({dt})"
                add("sdpa where(m, 0, fill)", where, "keep", v, fill)
            return out
        for f in (_scores_fill(b), b.small):
            add("masked_fill", lambda s, f=f: f"{s}.masked_fill(~{x}, {f})", "keep", v, f)
            add("masked_fill", lambda s, f=f: f"{s}.masked_fill({x}, {f})", "hide", v, f)
            add("masked_fill", lambda s, f=f: f"{s}.masked_fill({x} == 0, {f})", "keep", v, f)
            add("where", lambda s, f=f: f"torch.where({x}, {s}, {f})", "keep", v, f)
            add("where", lambda s, f=f: f"torch.where({x}, {f}, {s})", "hide", v, f)
        add("added bool", lambda s: f"{s} + {x}", "add", v)
        return out
    floats = v.is_floating_point()
    if sdpa:
        add("sdpa float mask", f"{x}.to({dt})" if v.dtype != b.w.dtype else x, "add", v)
        if floats:  # SDPA takes a float32 mask for any query dtype
            add("sdpa float mask", x, "add", v)
        fill = b.fill_for(dt)
        add("sdpa bool mask", f"{x}.bool()", "keep", v != 0)
        where = f"torch.where({x} == 0, {fill}, 0.0).to({dt})"
        add("sdpa where(m, 0, fill)", where, "hide", v == 0, fill)
        return out
    cast = ".to({}.dtype)" if floats and v.dtype != b.w.dtype else ""
    add("added bias", lambda s: f"{s} + {x}{cast.format(s)}", "add", v)
    fill = _scores_fill(b)
    add("masked_fill", lambda s: f"{s}.masked_fill({x} == 0, {fill})", "hide", v == 0, fill)
    add("masked_fill", lambda s: f"{s}.masked_fill({x}.bool(), {fill})", "hide", v != 0, fill)
    return out


def _scores_fill(b: Builder) -> str:
    """The mask's fill as the scores take it: -1e9 overflows float16 (`masked_fill` raises)."""
    fill = b.fill_for("torch.float32" if b.w.dtype == torch.float32 else b.w.dt)
    if b.w.dtype == torch.float16 and fill == "-1e9":
        return "-1e4"
    return fill


def site_terms(
    w: Any, dims: dict[str, int], style: str, q: str, namespace: dict
) -> Application | None:
    """Draws position terms for one attention site (a mask, a bias of key - query, or both) and
    how it applies them, such that every query keeps a key; writes their code into the program.
    Three things the attention pattern refuses (its reasons, not the docs') are not drawn: the
    code comes before the attention ("grad mode, autocast or an in-place op changes inside the
    attention"), the site applies the terms after its other biases ("a bias is added after a mask
    filled with ...; the kernel fills last"), and its other masks are left out, as a mask's fills
    are one value ("masks fill different values"). None where no draw gives such terms."""
    rng = w.rng
    which = pick(rng, ("mask", 6), ("relative", 2), ("both", 2))
    for _ in range(TRIES):
        b = Builder(w, dims, 2 if style in ("bmm", "baddbmm") else 4, q, namespace)
        try:
            app = _draw(b, which, style == "sdpa")
        except Invalid:
            continue
        if app is not None:
            b.commit()
            return app
    return None


def _draw(b: Builder, which: str, sdpa: bool) -> Application | None:
    rng, w = b.rng, b.w
    # A bias filled above the diagonal beside a mask gives the site two masks, whose fills differ
    # or come before the other's bias: the attention pattern refuses both ("masks fill different
    # values", "a bias is added after a mask filled with ..."), listed in docs/attention.md.
    bias = relative(b, masked=which == "relative") if which != "mask" else None
    x = mask(b) if which != "relative" else None
    for term in (bias, x):
        if term is not None and not b.fits(b.value(term)):
            return None
    if bias is not None and sdpa and b.value(bias).dtype != w.dtype:
        bias = b.let("rbias", f"{bias}.to({b.q}.dtype)")
    bias_visible = b.visible(b.value(bias), "add") if bias is not None else torch.tensor(True)
    choices = [Choice(None, None, "add", bias_visible)]
    if x is not None:
        choices = _applications(b, x, sdpa)
        for c in choices:
            c.visible = c.visible & bias_visible
        if sdpa and bias is not None:  # one float mask: the bias plus a float mask's term
            choices = [c for c in choices if _float_of(b, c.apply, w.dtype)]
    choices = [c for c in choices if b.every_row_keeps(c.visible)]
    if bias is not None and b.params:
        choices = [c for c in choices if b.rows_keeping_two(c.visible) > 0.5]
    natural = [c for c in choices if c.how in b.natural]
    if natural and rng.random() < 0.8:  # a canonical mask mostly applied as it is meant
        choices = natural
    if not choices:
        return None
    kind = rng.choice(sorted({c.kind for c in choices}, key=str))  # each kind alike
    variants = [c for c in choices if c.kind == kind]
    weights = [1 if c.fill == b.small else 3 for c in variants]  # fills that hide, mostly
    choice = rng.choices(variants, weights)[0]
    kind, apply = choice.kind, choice.apply
    if choice.fill is not None:
        b.filled(choice.fill)
    app = Application(notes=[])
    if kind is not None:
        b.kind(f"apply {kind}")
        app.notes.append(kind)
    if bias is not None:
        b.kind("apply relative bias")
        app.notes.append("relative bias")
    if sdpa:
        app.sdpa = bias if apply is None else apply
        if bias is not None and apply is not None:
            app.sdpa = b.let("amask", rng.choice([f"{bias} + {apply}", f"{apply} + {bias}"]))
        return app
    if bias is not None:
        cast = "" if b.value(bias).dtype == w.dtype else ".to({}.dtype)"
        app.written.append(lambda s: f"{s} + {bias}{cast.format(s)}")
    if apply is not None:
        app.written.append(apply)
    return app


def _float_of(b: Builder, expr: str, dtype: torch.dtype) -> bool:
    value = eval(expr, b.env)
    return value.is_floating_point() and value.dtype == dtype
