"""Distributional robustness and fairness across clients: DRFA's lambda sampling (:mod:`.lambda_sampling`, with
what it reports, :mod:`.lambda_report`), the per-client loss DRFA minimises the worst of (:mod:`.client_loss`), and
q-FedAvg (:mod:`.qffl`)."""
