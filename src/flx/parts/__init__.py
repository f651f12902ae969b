"""Algorithm parts: each module one mechanism of the round protocol (a proximal term, a client sampler, a server-side
update), a :class:`flx.hooks.FederatedCallback` listed in an algorithm config (``algo.parts``).

Parts see the federation only through :class:`flx.context.FederationView` (docs/round_protocol.md, "Core helpers for
parts"); the core never imports a part (``tests/test_imports.py``). The process callbacks (round checkpoints, the
progress bar, curves, line plots) are in :mod:`flx.callbacks`.
"""
