"""The headline metrics of a run and the final line (``flx.console``): pure functions, no Trainer."""

from __future__ import annotations

from types import SimpleNamespace

from flx.console import final_line, headline, present
from flx.hooks import FederatedCallback
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.parts.xrisk.passive_buffer import PassiveBuffer
from flx.tasks import Classification, Custom, MaskedLM, Regression
from flx.traits import PartTraits


def test_headline_is_the_tasks_then_the_parts_without_repeats() -> None:
    """The task's names come first, then each part's in list order; a name given twice is shown once; a plain
    Lightning callback (no ``headline``) and a part without one add nothing (a part names them in its traits)."""
    parts = [
        PassiveBuffer(),
        FederatedCallback(),
        SimpleNamespace(),
        SimpleNamespace(traits=PartTraits(headline=("acc", "extra"))),
    ]
    assert headline(Classification(), parts) == ("acc", "auroc", "pauc_0.3", "pauc_0.5", "extra")
    assert headline(Regression(), [LambdaSampling()]) == ("mse", "client_acc_worst", "client_mse_worst")
    assert headline(MaskedLM(), []) == ("acc", "ppl")
    assert headline(Custom(loss=abs), []) == ("loss",)
    assert headline(Custom(loss=abs, metric=abs, metric_name="mae"), []) == ("mae",)


def test_present_takes_the_first_split_that_logged_a_name() -> None:
    metrics = {"val/acc": 0.5, "test/acc": 0.6, "test/auroc": 0.7, "val/loss": 1.0}
    assert present(metrics, ("acc", "auroc", "ppl"), ("val", "test")) == {"val/acc": 0.5, "test/auroc": 0.7}


def test_final_line_keeps_the_classic_prefix_and_appends_the_rest() -> None:
    """``final test_acc=`` (classification) / ``final test_mse=`` (regression) come first, as scripts grep them; the
    other headline metrics follow in order with 4 decimals; names the test did not log are left out; the sweep's job
    label closes the line; no headline metric at all: no line."""
    metrics = {"test/acc": 0.91234, "test/loss": 0.3, "test/auroc": 0.88119, "test/pauc_0.3": 0.61}
    names = headline(Classification(), [PassiveBuffer()])
    assert final_line(metrics, names) == "final test_acc=0.9123 test_auroc=0.8812 test_pauc_0.3=0.6100"
    assert final_line({"test/mse": 2.5, "test/rmse": 1.58}, ("mse",)) == "final test_mse=2.5000"
    assert (
        final_line({"test/acc": 0.5}, ("acc",), "job 1 (algo.lr=0.1)")
        == "final test_acc=0.5000 for job 1 (algo.lr=0.1)"
    )
    assert final_line({"test/loss": 0.5}, ("acc",)) is None
