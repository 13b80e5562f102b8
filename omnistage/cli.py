"""The `omnistage` command line.

Each subcommand is a `Subcommand`: a function that declares its arguments and a function that
runs it. Adding one (`generate`, `serve`, `bench`) is one entry in `SUBCOMMANDS` plus its two
functions; heavy imports stay inside `run` so `omnistage --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the process exit code


def _tiny_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arch", help="architecture to build, e.g. qwen2")
    parser.add_argument("outdir", help="folder to write the checkpoint into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    parser.add_argument("--size", default="tiny", help="tiny (tests) or small (benchmarks); default: tiny")


def _tiny_run(args: argparse.Namespace) -> int:
    from omnistage.tiny import build_tiny

    print(build_tiny(args.arch, args.outdir, seed=args.seed, size=args.size))
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "tiny": Subcommand(
        help="build a tiny random HF-format checkpoint (weights, config, tokenizer) offline",
        add_arguments=_tiny_arguments,
        run=_tiny_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="omnistage: serve omni-modal models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from omnistage.errors import InvalidRequestError

    try:
        return SUBCOMMANDS[args.command].run(args)
    except InvalidRequestError as exc:
        # A user mistake: say what to change, no traceback.
        print(f"omnistage {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
