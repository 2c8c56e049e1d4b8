"""Triton kernels of cgist's loss stages (installed as ``cgist.kernels``): device code only.

``gist`` holds the dense stage's forward row pass and chunk score-gradient kernel, ``gemm`` the tf32x3 products of its
backward, ``maxsim`` the late-interaction (MaxSim) stage's forward and backward. They import only triton (and the standard
library), nothing of cgist: the host side (the launchers, the tile tables and the autotuner, the architecture
queries) is the Triton backend ``cgist.stage.triton``.

The source folder is named ``kernels``, which is also the name of a PyPI package (Hugging Face's, which transformers
requires and imports). Run from a checkout, with the current directory on ``sys.path``, ``import kernels`` finds this
folder first; imported under that top-level name, this module hands over to the installed PyPI package, so that
transformers gets what it asked for (``_hand_over``). As ``cgist.kernels`` it does nothing on import.
"""

import sys


def _hand_over() -> None:
    """Replace this module in ``sys.modules`` by the PyPI package ``kernels``, found on ``sys.path`` without this
    checkout; nothing happens where none is installed. The import that found this folder then returns that package
    (the import system reads ``sys.modules`` again after running a module)."""
    import importlib.machinery
    import importlib.util
    import os

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None:
        return
    package = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = package
    spec.loader.exec_module(package)


if __name__ == "kernels":
    _hand_over()
