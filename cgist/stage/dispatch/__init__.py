"""Which backend computes a loss-stage call, for every score (``route``: the one router, the fallback), and the check a
kernel variant passes before ``"auto"`` uses it (``selfcheck``). The only part of the package that reaches the Triton
backend (``cgist.stage.triton``)."""
