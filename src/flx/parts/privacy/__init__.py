"""Differential privacy: user-level central DP (DP-FedAvg, :mod:`.central_dp`), record-level local DP (DP-SGD in
every client, :mod:`.local_dp`), and what both share, their ``privacy.*`` keys and the budget (:mod:`.dp_budget`)."""
