"""Process callbacks: round checkpoints (:mod:`~flx.callbacks.checkpoint`), the round progress bar
(:mod:`~flx.callbacks.progress`), the recorded curves and line plots (:mod:`~flx.callbacks.curves`,
:mod:`~flx.callbacks.line_plots`). The algorithm parts are in :mod:`flx.parts`."""
