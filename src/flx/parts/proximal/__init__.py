"""Proximal local steps: FedProx's proximal term against client drift (:mod:`.prox`), and FedMiD / FedDualAvg's prox
steps for a nonsmooth regulariser (:mod:`.prox_step`)."""
