"""Which binary head a config asks for and how many outputs the net gets; torch-free, so the pre-run check can use it.

The heads themselves (loss, predictions, scores) are in :mod:`flx.models.heads`.
"""

from __future__ import annotations

from flx.errors import bad_value

HEADS = ("two_logits", "one_logit")


def num_outputs(head: str, num_classes: int) -> int:
    """Output columns of the net for ``model.binary_head=head`` on a task with ``num_classes`` classes.

    Raises:
        ConfigError: for an unknown head, or ``one_logit`` on a task that is not binary.
    """
    if head not in HEADS:
        raise bad_value("model.binary_head", head, f"allowed: {', '.join(HEADS)}")
    if head == "one_logit" and num_classes != 2:
        raise bad_value(
            "model.binary_head", head, f"one_logit needs a binary task (2 classes), the data has {num_classes}"
        )
    return 1 if head == "one_logit" else num_classes
