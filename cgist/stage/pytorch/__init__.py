"""The PyTorch backend, for CPUs and for GPUs that the Triton kernels do not serve: one module per score, each with the
backend contract (``forward``, ``backward``; docs/design.md#dispatch): ``dense`` (the dense score, ``similarity``
``"cos"``/``"dot"``: the streaming path in blocks of anchor rows) and ``maxsim`` (MaxSim and MeanMaxSim: row blocks of
queries swept over tiles of documents), with the buffers they reuse (``workspace``). It imports no other backend."""
