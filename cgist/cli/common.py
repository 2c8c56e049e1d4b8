"""What every ``cgist`` command shares: the error for bad input and the ``--device`` option's check.

It imports no other module of :mod:`cgist.cli`, so that each command imports it and none imports another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["UsageError", "resolve_device"]


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit code 2, before anything is written."""


def resolve_device(name: str | None) -> torch.device:
    """The ``--device`` option as a torch device that exists on this machine."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}; expected e.g. cpu, cuda or cuda:0") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device
