"""Triton kernels for the GIST loss (installed as ``cgist.kernels``).

``gist_loss_and_grads`` is the backend ``"triton"`` of ``cgist.gist_loss``: it runs on CUDA tensors, or
on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before import).

The launcher is imported on first use. Importing this package therefore has no side effects, which
matters because the source folder is named ``kernels``: run from a checkout, it is what
``import kernels`` finds, and transformers imports that name while probing for the PyPI package
``kernels``. An eager import here would pull in cgist, and with it transformers, mid-import.
"""

__all__ = ["gist_loss_and_grads"]


def __getattr__(name: str):
    if name == "gist_loss_and_grads":
        from .launch import gist_loss_and_grads

        return gist_loss_and_grads
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
