"""Federated meta-learning: AugFL's client step (:mod:`.meta_update`) and its server-side pretrained-model term
(:mod:`.pm_regularizer`), Per-FedAvg (:mod:`.per_fedavg`), and the fast adaptation they are evaluated by
(:mod:`.adapt`, also FedAvg's fine-tuning baseline)."""
