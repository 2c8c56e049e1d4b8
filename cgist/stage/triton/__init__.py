"""The Triton backend: the host side of the kernels (``cgist.kernels``, device code only), one module per score, each
with the backend contract (``forward``, ``backward``; docs/design.md#dispatch): ``dense`` (the dense score,
``similarity`` ``"cos"``/``"dot"``, over ``cgist.kernels.gist``) and ``maxsim`` (MaxSim and MeanMaxSim, over
``cgist.kernels.maxsim``); ``common`` holds what their launchers share, ``tiles`` the tile configs per architecture and
Triton release. It runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set
before import). Importing it imports triton, so only the router (``cgist.stage.dispatch.route``) reaches it, on first
use, by the registry of scores (``cgist.stage.spec.scores``); it imports no other backend."""
