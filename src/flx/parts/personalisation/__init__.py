"""Personalised federated learning: a model per client beside the global one. pFedFBE (:mod:`.fbe`), pFedMe
(:mod:`.pfedme`, with its Moreau-envelope solver :mod:`.moreau`), Ditto (:mod:`.ditto`), APFL's mixed models
(:mod:`.apfl`), FedALA's adaptive local aggregation (:mod:`.fedala`), and the personal model of a non-personalised
algorithm (:mod:`.personal_model`)."""
