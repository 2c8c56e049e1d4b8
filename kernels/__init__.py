"""Triton kernels for the GIST loss (installed as ``cgist.kernels``).

``gist_loss_and_grads`` is the backend ``"triton"`` of ``cgist.gist_loss``: it runs on CUDA tensors, or
on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before import).
"""

from .launch import gist_loss_and_grads

__all__ = ["gist_loss_and_grads"]
