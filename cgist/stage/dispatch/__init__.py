"""Which backend computes a loss-stage call, for every score (``route``: the one router, the fallback), the check a
kernel variant passes before ``"auto"`` uses it (``selfcheck``), and one dense backend's contract run directly on raw
columns, for tests and benchmarks (``direct``). The only part of the package that reaches the Triton backend
(``cgist.stage.triton``)."""
