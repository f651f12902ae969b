"""Heterogeneous devices: WHALE-FL's sub-network scheduling and its fixed-width baselines (:mod:`.subnetwork`), its
scheduling maths as pure functions (:mod:`.whale_utility`) and what it reports (:mod:`.whale_report`)."""
