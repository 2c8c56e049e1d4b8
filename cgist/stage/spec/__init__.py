"""What a loss-stage call asks and what it means, for every score: the registry of scores (``scores``: dense, MaxSim,
each one entry naming its module in every layer), the options of every family (``options``: ``GistOptions`` and its
column groups), the guide's source (``guide``), the call (``call``: ``StageCall``), each score's part of the problem
model and its door (``dense``, ``maxsim``), the checks they share (``checks``), the groups bound to a call's columns and
how each row's softmax ends (``problem``), and a row block held whole, its guide mask and exact softmax (``block``).
It imports no backend."""
