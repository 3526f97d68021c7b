"""Keras callbacks of a training run, in the order they must run.

``make_callbacks`` puts them in order: timing first (before any collective
can make a rank wait), then Horovod's metric averaging, then the exact
evaluation (whose numbers are already global and must not be averaged
again), and only then rank 0's writers, which read the final numbers.
"""

from __future__ import annotations

import csv
import os
import time

import numpy as np

from hvd_train import checkpoints
from hvd_train.compat import keras
from hvd_train.distributed import Context, average_variables, metric_average_callback
from hvd_train.evaluation import evaluate
from hvd_train.log import get_logger

log = get_logger("train")

METRIC_COLUMNS = (
    "epoch",
    "loss",
    "accuracy",
    "val_loss",
    "val_accuracy",
    "val_top5",
    "lr",
    "images_per_sec",
    "epoch_seconds",
)


class Throughput(keras.callbacks.Callback):
    """Adds ``epoch_seconds`` and ``images_per_sec`` (all ranks' images) to the logs.

    The clock covers the training steps of the epoch only, not evaluation.
    """

    def __init__(self, images_per_epoch: int):
        super().__init__()
        self.images_per_epoch = images_per_epoch
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        logs["epoch_seconds"] = seconds
        logs["images_per_sec"] = self.images_per_epoch / seconds


class InputWait(keras.callbacks.Callback):
    """Reports how long each epoch waited on S3 objects or shard blocks.

    The reader counts the time its consumer waited for a fetch that had not
    finished; the training stalled on storage for at most that long. Rank 0
    logs the slowest rank's wait and adds it to the logs as
    ``input_wait_seconds``.
    """

    def __init__(self, reader, ctx: Context):
        super().__init__()
        self.reader = reader
        self.ctx = ctx
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self.reader.stats()["wait_seconds"]

    def on_epoch_end(self, epoch, logs=None):
        waits = self.ctx.allgather_object(self.reader.stats()["wait_seconds"] - self._start, name=f"wait.{epoch}")
        worst = max(waits)
        logs["input_wait_seconds"] = worst
        seconds = float(logs.get("epoch_seconds") or 0.0)
        if self.ctx.is_root:
            log.info(
                "epoch %d: input waited %.2f s on storage (slowest rank; %.0f%% of the epoch's %.1f s)",
                epoch + 1,
                worst,
                100.0 * worst / seconds if seconds else 0.0,
                seconds,
            )


class LearningRate(keras.callbacks.Callback):
    """Adds the learning rate of the last step of the epoch to the logs."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.model.optimizer.iterations.numpy()) - 1
        logs["lr"] = float(self.schedule(max(step, 0)))


class AverageModelStatistics(keras.callbacks.Callback):
    """Averages BatchNorm moving statistics over ranks.

    Gradients are averaged, so trainable weights agree on every rank; but
    each rank updates BatchNorm's moving mean and variance from its own
    batches. Averaging them at the end of each epoch makes evaluation, the
    checkpoint and the saved model the same whichever rank they come from.
    """

    def __init__(self, ctx: Context):
        super().__init__()
        self.ctx = ctx

    def on_epoch_end(self, epoch, logs=None):
        variables = [
            v
            for layer in self.model.submodules
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)
        ]
        average_variables(variables, self.ctx, name=f"model_statistics.{epoch}")


class ExactEvaluation(keras.callbacks.Callback):
    """Scores every held-out image once after each epoch (all ranks take part)."""

    def __init__(self, make_dataset, num_classes: int, ctx: Context):
        super().__init__()
        self.make_dataset = make_dataset
        self.num_classes = num_classes
        self.ctx = ctx
        self.last = None

    def on_epoch_end(self, epoch, logs=None):
        self.last = evaluate(self.model, self.make_dataset(), self.num_classes, self.ctx, name=f"val.{epoch}")
        logs["val_loss"] = self.last.loss
        logs["val_accuracy"] = self.last.accuracy
        logs["val_top5"] = self.last.top5


class MetricsCSV(keras.callbacks.Callback):
    """Rank 0: one row per epoch in ``metrics.csv``, flushed at once."""

    def __init__(self, path: str, keep_epochs: int):
        super().__init__()
        self.path = path
        rows = []
        if keep_epochs and os.path.isfile(path):
            with open(path, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(r["epoch"]) <= keep_epochs]
        # Rewritten whole: rows of epochs after the resumed checkpoint are dropped.
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1}
        for key in METRIC_COLUMNS[1:]:
            value = logs.get(key)
            row[key] = "" if value is None else f"{float(value):.6g}"
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=METRIC_COLUMNS).writerow(row)


class EpochCheckpoint(keras.callbacks.Callback):
    """Rank 0: an atomic checkpoint after every epoch."""

    def __init__(self, output: str, keep: int, state: dict):
        super().__init__()
        self.output = output
        self.keep = keep
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        metrics = {k: float(v) for k, v in (logs or {}).items() if np.isscalar(v)}
        path = checkpoints.save(
            self.output,
            epoch + 1,
            self.model,
            self.model.optimizer,
            {**self.state, "metrics": metrics},
            self.keep,
        )
        log.debug("checkpoint %s", path)


def make_callbacks(
    *,
    ctx: Context,
    schedule,
    images_per_epoch: int,
    evaluation: ExactEvaluation | None,
    output: str,
    initial_epoch: int,
    keep_checkpoints: int,
    tensorboard: bool,
    state: dict,
    reader=None,
) -> list[keras.callbacks.Callback]:
    """The callbacks of one rank, in the order they must run."""
    callbacks: list[keras.callbacks.Callback] = [Throughput(images_per_epoch), LearningRate(schedule)]
    # Horovod: average loss/accuracy/timings over ranks before anyone reads them.
    callbacks.append(metric_average_callback())
    if reader is not None:
        callbacks.append(InputWait(reader, ctx))
    # Horovod: BatchNorm statistics agree on all ranks before evaluation and saving.
    callbacks.append(AverageModelStatistics(ctx))
    if evaluation is not None:
        callbacks.append(evaluation)
    if ctx.is_root:
        # Horovod: only rank 0 writes files and prints progress.
        callbacks.append(MetricsCSV(os.path.join(output, "metrics.csv"), initial_epoch))
        callbacks.append(EpochCheckpoint(output, keep_checkpoints, state))
        if tensorboard:
            callbacks.append(keras.callbacks.TensorBoard(os.path.join(output, "tensorboard"), profile_batch=0))
        callbacks.append(keras.callbacks.ProgbarLogger(count_mode="steps"))
    return callbacks
