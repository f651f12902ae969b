"""Proximal local steps and local objective terms: FedProx's proximal term against client drift (:mod:`.prox`), MOON's
model-contrastive term (:mod:`.moon`), and FedMiD / FedDualAvg's prox steps for a nonsmooth regulariser
(:mod:`.prox_step`)."""
