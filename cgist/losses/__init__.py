"""The drop-ins: sentence-transformers' losses with the fused loss stage (``cgist.stage``).

* ``base``: what every drop-in shares: the attributes as the options (``FusedDropIn``), the loss stage of a step
  (``fused_loss_stage``) and the takeover of ``MatryoshkaLoss`` (``FusedMatryoshka``).
* ``gist``: ``FusedCachedGISTLoss``; ``ranking``: the cached ranking losses.
* ``precompute``: a guide's embeddings of a dataset as its label column (``add_guide_embeddings``);
  ``callbacks``: the guide's statistics in the trainer's logs (``GuideStatsCallback``).
"""
