"""The Triton backend: the host side of the kernels (``cgist.kernels``). ``launch`` launches them (tensors in, tensors
out) and ``tiles`` picks their tile configs per architecture and Triton release; ``gist_loss_and_grads`` is the
backend ``"triton"`` of ``cgist.gist_loss``, on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before import). Importing it imports triton, so only the router
(``cgist.stage.dispatch.route``) reaches it, on first use."""

from .launch import gist_loss_and_grads

__all__ = ["gist_loss_and_grads"]
