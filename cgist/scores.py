"""Adding a score to the loss stage, from outside the package (docs/design.md#adding-a-score): what a score's modules
use, in one place.

A score is a registry entry (``Score``, added with ``register_score``) and its modules, named by the entry: a spec
module (its ``door``, which builds the checked call from a user's arguments, and optionally ``check_options``), a
PyTorch backend (``forward(call, with_grad, need_stats) -> (loss, Grads | None, counters | None)``), optionally a
Triton one, and optionally a ``scorer`` through which a multi-vector drop-in recognises its ``similarity_fct``. The
stage does the rest: the options, the one autograd node (``run``) with the call's learned parameters, the router and
its fallback, the statistics, ``cgist doctor``. ``SCORES`` lists the registered scores.

A token score's door builds its call with ``maxsim_call`` (the checks of MaxSim's arguments, into its ``call_class``,
a ``MaxSimCall``, with its own learned ``parameters``); its backend returns ``Grads``, one gradient per input chunk
(``StageCall.tensors``) and one per learned parameter (``StageCall.parameters``, ``TEMPERATURE`` among them where the
temperature is learned).
"""

from __future__ import annotations

from .stage.node import run
from .stage.spec.call import TEMPERATURE, Grads, StageCall
from .stage.spec.maxsim import MaxSimCall, maxsim_call
from .stage.spec.options import GistOptions
from .stage.spec.scores import SCORES, Score, register_score, score_of
from .stage.stats import GistStats

__all__ = ["SCORES", "TEMPERATURE", "GistOptions", "GistStats", "Grads", "MaxSimCall", "Score", "StageCall",
           "maxsim_call", "register_score", "run", "score_of"]
