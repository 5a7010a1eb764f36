"""Training curves of one rank: what ``train_step`` and ``eval_step`` returned, per step.

The loss is the one figure everyone training a model watches first, so it travels with the
other telemetry. ``train_step`` already reads the loss (and the grad norm) on the host in its
one synchronization, so recording them costs no extra device sync: the learning rate is a
Python float in the optimizer's ``param_groups`` and the loss scale a float in its scaler.

The notebook polls through datapub, which keeps only the latest value per key, so the block
published is a rolling window of the last ``window`` points plus per-cell counts; the notebook
merges windows by step number (``workbench/ui/dashboard/curves.py``), so a point is lost only if
more than ``window`` steps ran between two publishes (4 per second: over ~1000 steps/s).
Step numbers count this cell's training steps from 1 (``Telemetry.new_cell`` resets them), so
a cell's curve, its TensorBoard run and the losses the cell returned line up step for step.
The published block, under the snapshot's ``curves`` key::

    steps, skipped                   training steps recorded / skipped (fp16 overflow), this cell
    train: [[step, loss, lr, grad_norm, loss_scale, stepped], ...]   the last ``window``
    eval:  [[step, loss], ...]       eval losses, at the number of training steps before them

``grad_norm`` is None unless the optimizer clips (it is measured only then); ``lr`` is the
first parameter group's. No torch here, as for the rest of the telemetry package.
"""

from __future__ import annotations

from collections import deque
from typing import Any

TRAIN_FIELDS = ("step", "loss", "lr", "grad_norm", "loss_scale", "stepped")


class TrainingCurves:
    """Per-cell loss, eval loss, LR, grad norm, loss scale and skipped steps of one rank."""

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self.new_cell()

    def new_cell(self) -> None:
        """A new cell starts: step numbers start again from 1 and the window empties."""
        self.steps = 0
        self.skipped = 0
        self.evals = 0
        self.train: deque[list[Any]] = deque(maxlen=self.window)
        self.eval: deque[list[Any]] = deque(maxlen=self.window)

    def record_train(self, loss: float, stepped: bool, grad_norm: float | None,
                     lr: float | None, loss_scale: float | None) -> None:
        """One ``train_step``'s result; the values are kept as given (exact, not rounded)."""
        self.steps += 1
        self.skipped += 0 if stepped else 1
        self.train.append([self.steps, loss, lr, grad_norm, loss_scale, bool(stepped)])

    def record_eval(self, loss: float) -> None:
        """One ``eval_step``'s loss, placed at the training steps taken before it."""
        self.evals += 1
        self.eval.append([self.steps, loss])

    def block(self) -> dict[str, Any] | None:
        """The published block (see the module docstring), or None: nothing recorded yet."""
        if not self.train and not self.eval:
            return None
        return {"steps": self.steps, "skipped": self.skipped,
                "train": [list(p) for p in self.train], "eval": [list(p) for p in self.eval]}

    def state(self) -> tuple[int, int]:
        """What makes a flush publish: the count of training and eval points so far."""
        return (self.steps, self.evals)
