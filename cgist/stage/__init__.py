"""The loss stage: one op, from the options of a call to the backend that computes it.

A call reads downward:

* ``spec/``: what was asked and what it means. ``options`` (``GistOptions`` and its column groups), ``guide`` (where
  the guide comes from), ``checks`` (the arguments checked once), ``problem`` (the groups bound to the call's columns,
  the Matryoshka dimensions, and how each row's softmax ends, written once for both backends).
* ``dispatch/``: which backend runs it (``route``) and the kernels' proof on first use (``selfcheck``); the one place
  that reaches the Triton backend.
* ``pytorch/``: the PyTorch streaming path (``streaming``, ``workspace``), for CPUs and GPUs the kernels do not serve.
* ``triton/``: the Triton backend, the host side of the kernels (``cgist.kernels``, device code only): the launcher
  (``launch``) and the tile configs (``tiles``).
* ``reference``: the dense oracle the tests hold both backends to.
* Shared by all of them: ``numerics`` (normalisation, threshold, guide mask, half products), ``ties`` (tie ids and
  text fingerprints), ``budget`` (the workspace budget, its only owner), ``stats`` (``GistStats`` and the counters'
  layout) and ``devices`` (GPU architectures as the tiles see them).
"""
