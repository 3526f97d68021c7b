"""What rank 0 writes and prints after every epoch: metrics.csv, curves.png, TensorBoard, progress.

Every writer is idempotent per epoch: writing epoch ``e`` again (after a
resume, or after an elastic job rolled back) replaces its row instead of
adding one.
"""

from __future__ import annotations

import csv
import io
import os
import sys
import threading
import time
from collections.abc import Callable

from hvd_train import files, plots
from hvd_train.log import get_logger

log = get_logger("train")


def draw(path: str, plot: Callable[[], None]) -> bool:
    """Draws the picture ``path`` with ``plot()``; a failure is a warning, never the end of a run."""
    try:
        plot()
        return True
    except Exception as e:  # matplotlib raises many types (fonts, memory, disk)
        log.warning("could not draw %s: %s", path, e)
        return False


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


class MetricsCSV:
    """``metrics.csv``: one row per epoch, rewritten whole so a row is never half there."""

    def __init__(self, path: str):
        self.path = path

    def rows(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def write(self, epoch: int, logs: dict) -> None:
        """Writes the row of ``epoch`` (1-based) and drops rows of later epochs."""
        rows = [r for r in self.rows() if r.get("epoch", "").isdigit() and int(r["epoch"]) < epoch]
        row = {"epoch": epoch}
        for key in METRIC_COLUMNS[1:]:
            value = logs.get(key)
            row[key] = "" if value is None else f"{float(value):.6g}"
        self.save([*rows, row])

    def save(self, rows: list[dict]) -> None:
        """Replaces the file with ``rows`` (atomically)."""
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        files.write_text(self.path, table.getvalue())


class TensorBoard:
    """Epoch scalars under ``tensorboard/train`` and ``tensorboard/validation``."""

    def __init__(self, folder: str):
        from hvd_train.compat import tf

        self._train = tf.summary.create_file_writer(os.path.join(folder, "train"))
        self._val = tf.summary.create_file_writer(os.path.join(folder, "validation"))

    def write(self, epoch: int, logs: dict) -> None:
        from hvd_train.compat import tf

        for writer, prefix in ((self._train, ""), (self._val, "val_")):
            with writer.as_default(step=epoch):
                for key, value in logs.items():
                    if value is None or not isinstance(value, int | float):
                        continue
                    if prefix and key.startswith(prefix):
                        tf.summary.scalar(f"epoch_{key[len(prefix) :]}", value)
                    elif not prefix and not key.startswith("val_"):
                        tf.summary.scalar(f"epoch_{key}", value)
            writer.flush()


class Progress:
    """``Epoch e/E`` and a progress bar (a terminal) or one line per epoch (a log file)."""

    def __init__(self, epochs: int):
        self.epochs = epochs
        self.interactive = sys.stdout.isatty()
        self._bar = None
        self._started = 0.0

    def begin(self, epoch: int, steps: int, first_step: int) -> None:
        print(f"Epoch {epoch + 1}/{self.epochs}", flush=True)
        self._started = time.perf_counter()
        if self.interactive:
            from hvd_train.compat import keras

            self._bar = keras.utils.Progbar(steps, stateful_metrics=["loss", "accuracy"])
            if first_step:
                self._bar.update(first_step)

    def step(self, done: int, logs: dict) -> None:
        if self._bar is not None:
            self._bar.update(done, [(k, float(v)) for k, v in logs.items()])

    def end(self, steps: int, logs: dict) -> None:
        self._bar = None
        shown = " - ".join(
            f"{k}: {v:.4f}" for k, v in logs.items() if k in ("loss", "accuracy", "val_loss", "val_accuracy")
        )
        print(f"{steps}/{steps} - {time.perf_counter() - self._started:.0f}s - {shown}", flush=True)


class Reporters:
    """Rank 0's writers of one run."""

    def __init__(self, output: str, epochs: int, tensorboard: bool, title: str = ""):
        self.csv = MetricsCSV(os.path.join(output, "metrics.csv"))
        self.curves = os.path.join(output, plots.CURVES)
        self.title = title
        # Drawn off the training thread: a stop request must not wait for matplotlib
        # (plain mpirun kills 1 s after passing SIGTERM on). A daemon thread: a
        # process that exits mid-draw leaves the previous picture in place.
        # The painter draws the latest rows handed over; epochs count what was
        # handed over and what is drawn, so ``wait`` cannot return early.
        self._painter = threading.Condition()
        self._latest: list[dict] | None = None
        self._handed = self._drawn = 0
        threading.Thread(target=self._paint, name="curves", daemon=True).start()
        self.tensorboard = TensorBoard(os.path.join(output, "tensorboard")) if tensorboard else None
        self.progress = Progress(epochs)

    def epoch_end(self, epoch: int, logs: dict) -> None:
        """Writes epoch ``epoch`` (0-based) everywhere."""
        self.csv.write(epoch + 1, logs)
        with self._painter:
            self._latest = self.csv.rows()
            self._handed += 1
            self._painter.notify_all()
        if self.tensorboard is not None:
            self.tensorboard.write(epoch + 1, logs)

    def _paint(self) -> None:
        # matplotlib's import and first figure cost ~1 s: paid now, while the first
        # epoch traces its graph, not at an epoch end next to a checkpoint.
        draw(self.curves, lambda: plots.curves([], io.BytesIO()))
        while True:
            with self._painter:
                self._painter.wait_for(lambda: self._latest is not None)
                rows, handed, self._latest = self._latest, self._handed, None  # only the latest epochs matter
            draw(self.curves, lambda rows=rows: plots.curves(rows, self.curves, self.title))
            with self._painter:
                self._drawn = handed
                self._painter.notify_all()

    def wait(self, timeout: float = 30.0) -> bool:
        """Waits until curves.png shows every epoch written so far."""
        with self._painter:
            return self._painter.wait_for(lambda: self._drawn >= self._handed, timeout)

    def truncate(self, epochs_done: int) -> None:
        """Drops rows of epochs after ``epochs_done`` (a run that starts over or rolled back)."""
        before = self.csv.rows()
        rows = [r for r in before if r.get("epoch", "").isdigit() and int(r["epoch"]) <= epochs_done]
        if len(rows) != len(before) or not os.path.isfile(self.csv.path):
            self.csv.save(rows)
