"""Federated X-risk (pairwise AUC) optimisation: FeDXL's passive buffer (:mod:`.passive_buffer`, its first pools
and draws in :mod:`.fedxl_pools`), the CODASCA baseline (:mod:`.codasca`) and FeDXL's per-client input noise
(:mod:`.client_noise`)."""
