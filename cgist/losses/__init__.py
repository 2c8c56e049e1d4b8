"""The drop-ins: sentence-transformers' losses with the fused loss stage (``cgist.stage``), each one class over three
pieces (docs/design.md#the-drop-in-protocol).

* ``base``: the drop-in protocol (``FusedDropIn``): construction and checks, the options read off the attributes
  and cached, ``calculate_loss`` and the loss-stage call, the fallback to sentence-transformers' own computation;
  ``options``: the table of cgist's own options every drop-in takes.
* ``steps``: how a batch is embedded, GradCache's mini-batches (``CachedStep``) or one forward pass (``PlainStep``).
* ``columns``: the component a family holds for its score's kind of column, which builds the loss stage's call from
  a ``StageBatch`` and embeds a plain step's batch: embeddings (``DenseColumns``, the dense score) or token embeddings
  and their masks (``TokenColumns``, the MaxSim and XTR scores).
* ``gist``: the GIST family (``FusedCachedGISTLoss``, ``FusedGISTEmbedLoss``); ``ranking``: the ranking family (the
  cached and plain ``MultipleNegativesRankingLoss`` and its symmetric variant); ``multi_vector``: the late-interaction
  family (the cached and plain ``MultiVectorMultipleNegativesRankingLoss``, the MaxSim score); ``multi_vector_gist``:
  GIST's guide over it (``FusedCachedMultiVectorGISTLoss``, ``FusedMultiVectorGISTLoss``); ``guided``: what the guided
  families share.
* ``matryoshka``: the takeover of ``MatryoshkaLoss``'s decoration (every dimension in one loss stage).
* ``precompute``: a guide's embeddings of a dataset as its label column (``add_guide_embeddings``);
  ``callbacks``: the guide's statistics in the trainer's logs (``GuideStatsCallback``).
"""
