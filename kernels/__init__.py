"""Triton kernels for the GIST loss (installed as ``cgist.kernels``): device code only.

``gist`` holds the forward row pass and the chunk score-gradient kernel, ``gemm`` the tf32x3 products of the
backward. They import only triton (and the standard library), nothing of cgist: the host side (the launcher, the tile
tables and the autotuner, the architecture queries) is the Triton backend ``cgist.stage.triton``, whose
``gist_loss_and_grads`` is the backend ``"triton"`` of ``cgist.gist_loss``.

Importing this package has no side effects, which matters because the source folder is named ``kernels``: run from
a checkout, it is what ``import kernels`` finds, and transformers imports that name while probing for the PyPI
package ``kernels``. An import here would run mid-way through transformers' own.
"""
