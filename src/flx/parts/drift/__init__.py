"""Parts that correct client drift and objective inconsistency: SCAFFOLD, FedDyn, FedNova."""
