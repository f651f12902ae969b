"""Parts that only measure the global (and personalised) models at evaluation: logged numbers (:mod:`.logged`), the
composite objective (:mod:`.objective`), and the learned structure against the ground truth (:mod:`.structure`)."""
