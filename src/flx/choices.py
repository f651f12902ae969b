"""The allowed values of the config keys whose owners need torch: one list per key, read by the owner (which builds
its table from it) and by the pre-run check (:mod:`flx.config`, which imports no torch, so a bad value is refused in
a second, before anything heavy loads). Nothing else keeps a copy.
"""

from __future__ import annotations

CLIENT_EVAL = ("holdout", "test_labels", "test_group")
"""What a client's accuracy is measured on (``client_eval``); owner :class:`flx.datamodules.datamodule.
FederatedDataModule`."""
MODEL_INITS = ("default", "zeros")
"""Starting weights (``model.init``); owner :mod:`flx.models.init`."""
FAULT_POLICIES = ("drop", "stop")
"""What a client with a non-finite loss or update does to the round (``fault.policy``); owner :func:`flx.faults.judge`
(docs/round_protocol.md)."""
SINGLE_ROW_BATCH = ("auto", "drop", "keep")
"""Local minibatches of one row (``algo.single_row_batch``); owner :class:`flx.federation.Federation`
(``min_rows``) and :func:`flx.sampling.local_batches`."""
DUPLICATES = ("multiplicity", "repeat")
"""How a client drawn ``k`` times in one cohort trains (``algo.duplicates``); owner :class:`flx.context.Round` (the
copies) and :class:`flx.clients.ClientRunner`."""
AGGREGATORS = ("mean", "count_mean", "admm_sum")
"""``algo.aggregator``: the keys of :data:`flx.aggregation.AGGREGATORS`, in that order."""
SERVER_OPTIMIZERS = ("sgd", "adam", "adagrad", "yogi")
"""``algo.server.name``; owner :class:`flx.server.ServerOptimizer` (checked once, by the pre-run check)."""
ADAPTIVE_SERVER_OPTIMIZERS = ("adam", "adagrad", "yogi")
"""The adaptive ones of :data:`SERVER_OPTIMIZERS` (``m_t / (sqrt(v_t) + tau)``, Reddi et al. Algorithm 2): their
``eps`` is ``tau``, what a divergence message names (:func:`flx.faults.optimizer_cause`)."""
MINIBATCH = ("epochs", "fresh")
"""``algo.minibatch``: the keys of :data:`flx.sampling.MINIBATCH_STREAMS`, in that order."""
