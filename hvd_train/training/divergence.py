"""A run whose loss turns non-finite stops, on every rank after the same step, and keeps its last finite checkpoint.

A learning rate too high for the model (or a loss scale, data or weights
gone wrong) makes the loss grow, then overflow: ``inf``, then ``nan``. From
there every update writes ``nan`` into the weights, and training on
computes nothing but costs hours, and writes checkpoints that a resume
would take up. So each rank watches its own loss: the compiled steps sum,
with the other flags every call gives (``boundary``), whether this rank's
loss of the epoch so far is finite, and the ranks stop together one call
later; the epoch's end checks the loss averaged over ranks; and a
checkpoint is written only where every rank's weights, statistics and
optimizer values are finite. The run ends with ``Diverged`` (exit status
3) on every rank, its checkpoints as they were: the newest is the last
finite one.

Under a loss scale (``mixed_float16``) a step whose gradients or loss are
not finite is skipped, the weights as they were, and the scale halved: that
is no divergence, and the loss is not watched. A forward pass that overflows
float16 still writes inf into the BatchNorm statistics, which the
checkpoints' check finds and names.
"""

from __future__ import annotations

from hvd_train.errors import Diverged


def error(cfg, state, lr: float, what: str, checkpoint: str | None, loss_scaled: bool = False) -> Diverged:
    """The one-line error of a diverged run, on every rank alike.

    Args:
        cfg: the run's configuration.
        state: where the run stands (its epoch and step).
        lr: the learning rate of the last step.
        what: what was not finite, e.g. ``the loss of 1 of 2 rank(s)``.
        checkpoint: where the last finite checkpoint is, or None.
        loss_scaled: the run computes in float16 under a loss scale (its range may be what overflowed).
    """
    # At an epoch's end the state has moved on to the next epoch already.
    epoch = state.epoch if state.samples == 0 and state.epoch > 0 else state.epoch + 1
    if checkpoint:
        kept, then = (
            f"the last finite checkpoint, {checkpoint}, is kept",
            "rerun to resume from it (or add --no-resume)",
        )
    else:
        kept, then = "no checkpoint was written", "rerun"
    return Diverged(
        f"training diverged: {what} turned non-finite in epoch {epoch}/{cfg.run.epochs}, by step {state.step} "
        f"(learning rate {lr:.4g}, --base-lr {cfg.optim.base_lr:g}); {kept}. Lower --base-lr (`hvd-train "
        f"lr-find` suggests one) or warm up longer (--warmup-epochs)"
        f"{', or compute in a wider range (--precision mixed_bfloat16 or fp32)' if loss_scaled else ''}, then {then}.",
        agreed=True,
    )
