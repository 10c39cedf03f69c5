"""The `seqfast` command (also `python -m seqcompile`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqfast", description="seqcompile: fused transformer training for torch.compile"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small GPT with eager, Inductor and seqfast and compare them"
    )
    demo.add_argument("--steps", type=int, default=12, help="training steps per run (>= 2)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 2:
            parser.error("--steps must be at least 2")
        from seqcompile.demo import run_demo

        run_demo(steps=args.steps, device=args.device)
    return 0
