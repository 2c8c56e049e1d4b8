"""The loss stage: one op for every score (dense dot/cosine over vectors; MaxSim and MeanMaxSim over tokens), from a
call's options to the backend that computes it.

A call reads downward:

* ``spec/``: what was asked and what it means. ``scores`` (the registry: each score's module in every layer),
  ``options`` (``GistOptions`` and its column groups, for every score), ``guide`` (where the guide comes from),
  ``call`` (``StageCall``), each score's problem model and door (``dense``, ``maxsim``), ``checks``, ``problem`` (the
  groups bound to a call's columns, the Matryoshka dimensions, how each row's softmax ends) and ``block`` (a row
  block held whole: the guide's mask and the exact softmax), written once for every backend.
* ``node``: the one autograd node (``run``).
* ``dispatch/``: which backend runs it (``route``, with the fallback) and the kernels' proof on first use
  (``selfcheck``); the one place that reaches the Triton backend.
* ``pytorch/``: the PyTorch backend (``dense``, ``maxsim``, ``workspace``), for CPUs and GPUs the kernels do not serve.
* ``triton/``: the Triton backend, the host side of the kernels (``cgist.kernels``, device code only): ``dense``,
  ``maxsim``, ``common``, ``tiles``.
* ``reference``: the dense oracle the tests hold both backends to.
* Shared by all of them: ``numerics`` (normalisation, threshold, guide mask, half products), ``ties`` (tie ids and
  text fingerprints), ``budget`` (the workspace budget of every score, its only owner), ``stats`` (``GistStats`` and
  the counters' layout) and ``devices`` (GPU architectures as the tiles see them).
"""
