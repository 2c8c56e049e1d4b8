"""The XTR score on the Triton backend (docs/design.md#xtr): the MaxSim kernels' held path
(``cgist.stage.triton.maxsim.maxsim_held_triton``) with their ``XTR`` constexpr, after the thresholds' sweep
(``cgist.stage.xtr_thresholds.thresholds``, torch on the call's device). It imports only torch, its MaxSim
launchers, the spec and the thresholds.
"""

from __future__ import annotations

from ..spec.xtr import XTRCall
from ..xtr_thresholds import thresholds
from . import maxsim

__all__ = ["forward"]


def forward(call: XTRCall, with_grad: bool, need_stats: bool = False):
    """The backend contract's forward (``cgist.stage.triton.maxsim.forward``'s), with XTR's thresholds."""
    return maxsim.forward(call, with_grad, need_stats, tau=thresholds(call))

