"""Device / latency simulation (system heterogeneity), a service of the core: docs/systems.md.

:mod:`~flx.systems.profiles` (compute table, model size, link rates), :mod:`~flx.systems.params` (the ``system.*``
settings and their checks), :mod:`~flx.systems.traces` (seeded per-round link and load), :mod:`~flx.systems.simulator`
(``LatencySimulator``: device, unit and round times), :mod:`~flx.systems.clock` (``SimClock``: the run's simulated
wall-clock). A run built with ``system=mobile20`` hands the simulator to the federation (``fed.system``); parts query it
and record the width each client trains at with ``rnd.set_width`` (:meth:`flx.context.Round.set_width`). Nothing is
imported here: the pre-run check imports :mod:`~flx.systems.params` without numpy.
"""
