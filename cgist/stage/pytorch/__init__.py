"""The PyTorch streaming path: the loss stage in blocks of anchor rows (``streaming``), with the buffers they reuse
(``workspace``); on CPUs, and on GPUs that the Triton kernels do not serve."""
