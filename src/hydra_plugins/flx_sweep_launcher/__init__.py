"""``hydra/launcher=slurm``: Hydra's submitit SLURM launcher that reports every job of the sweep.

(It lives in the ``hydra_plugins`` namespace because Hydra instantiates launchers only from there.)

Each sweep point runs as one SLURM job (an array job). This launcher says where each job writes when it submits
them, waits for all of them, then prints one line per job: its overrides and final metrics, or its error. A job that
failed on bad input does not stop the others; the launching process exits non-zero once the sweep is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

from flx.errors import one_line
from flx.launch import record_failure, varying


class SlurmSweepLauncher(SlurmLauncher):
    """:class:`SlurmLauncher` with a report per job (see the module docstring)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = str(self.config.hydra.sweep.dir)
        print(
            f"flx: {len(job_overrides)} sweep job(s) to SLURM: job k writes to {sweep_dir}/k, its console to "
            f"{sweep_dir}/.submitit/<job id>_k/; waiting for them",
            flush=True,
        )
        returns = super().launch(job_overrides, initial_job_idx)
        for k, (ret, overrides) in enumerate(zip(returns, job_overrides), start=initial_job_idx):
            label = f"job {k} ({' '.join(varying(filter_overrides(overrides), sweep_dir))})"
            print(report(ret, label), flush=True)
        return returns


def report(ret: JobReturn, label: str) -> str:
    """One line for a finished sweep job; a failed job is recorded (:func:`flx.launch.record_failure`)."""
    try:
        value: Any = ret.return_value  # raises what the job raised (a crash, not bad input: that returns a status)
    except Exception as err:
        value = {"status": 1, "error": one_line(err)}
    if not isinstance(value, dict) or value.get("status", 0) != 0:
        status = value.get("status", 1) if isinstance(value, dict) else 1
        record_failure(label, status)
        error = value.get("error", "") if isinstance(value, dict) else str(value)
        return f"flx: {label}: failed (exit status {status}): {error}"
    metrics = " ".join(f"{k.replace('/', '_')}={v:.4f}" for k, v in value.items() if k.startswith("test/"))
    return f"flx: {label}: final {metrics} ({value.get('output_dir')})"
