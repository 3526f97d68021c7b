"""What rank 0 writes and prints after every epoch: metrics.csv, curves.png, TensorBoard, progress.

Every writer is idempotent per epoch: writing epoch ``e`` again (after a
resume, or after an elastic job rolled back) replaces its row instead of
adding one.
"""

from __future__ import annotations

import csv
import errno
import io
import os
import sys
import threading
import time

from hvd_train import files
from hvd_train.config import parse_every
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger
from hvd_train.results import plots

log = get_logger("train")

# A terminal's progress bar shows the metrics at most this often (seconds).
BAR_SECONDS = 0.25

# The painter's share of the run's time at most. A picture of the curves takes
# ~0.25 s of CPU and the GIL from the steps beside it: with a picture after
# every epoch, MobileNetV2's 2-second epochs on 2 cores ran 6-8 % slower; at a
# 2 % share, the epoch with a picture in it 15 % slower. After each picture
# (and matplotlib's warm-up) the painter waits until its CPU time is this
# share of the time since (about a minute on 2 cores); the last picture is
# drawn at once, and ``wait`` draws one now.
PAINT_SHARE = 0.005

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
# A multi-label run's (its accuracy columns stay empty): after the others, only when a run has them.
MULTI_LABEL_COLUMNS = ("f1", "val_map", "val_f1")


class MetricsCSV:
    """``metrics.csv``: one row per epoch, rewritten whole so a row is never half there."""

    def __init__(self, path: str):
        self.path = path

    def rows(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def with_row(self, epoch: int, logs: dict) -> list[dict]:
        """The rows of the file with the row of ``epoch`` (1-based), and without rows of later epochs."""
        rows = [r for r in self.rows() if r.get("epoch", "").isdigit() and int(r["epoch"]) < epoch]
        row = {"epoch": str(epoch)}
        for key in (*METRIC_COLUMNS[1:], *MULTI_LABEL_COLUMNS):
            value = logs.get(key)
            if value is not None or key in METRIC_COLUMNS:
                row[key] = "" if value is None else f"{float(value):.6g}"
        return [*rows, row]

    def write(self, epoch: int, logs: dict) -> None:
        """Writes the row of ``epoch`` (1-based) and drops rows of later epochs."""
        self.save(self.with_row(epoch, logs))

    def save(self, rows: list[dict]) -> None:
        """Replaces the file with ``rows`` (atomically)."""
        table = io.StringIO()
        extra = [key for key in MULTI_LABEL_COLUMNS if any(row.get(key) for row in rows)]
        writer = csv.DictWriter(table, fieldnames=[*METRIC_COLUMNS, *extra], restval="")
        writer.writeheader()
        writer.writerows(rows)
        files.write_text(self.path, table.getvalue())


class TensorBoard:
    """Epoch scalars under ``tensorboard/train`` and ``tensorboard/validation``."""

    def __init__(self, folder: str):
        from hvd_train.compat import tf

        self._train = tf.summary.create_file_writer(os.path.join(folder, "train"))
        self._val = tf.summary.create_file_writer(os.path.join(folder, "validation"))

    def write_step(self, step: int, values: dict) -> None:
        """Scalars of the last ``--log-every`` interval, as ``step_<name>`` at ``step`` (counted over the run)."""
        from hvd_train.compat import tf

        with self._train.as_default(step=step):
            for key, value in values.items():
                tf.summary.scalar(f"step_{key}", value)
        self._train.flush()

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
    """``Epoch e/E``, then a progress bar (a terminal) or lines (a log file), and one line at the epoch's end.

    Every ``--log-every`` (steps or seconds), a log file gets a line with the
    step within the epoch, images/s since the last line, loss, accuracy and
    the epoch's ETA: on a cluster, a slow job and a hung one look different.
    TensorBoard, when on, gets the same numbers at the same interval
    (``step_loss``, ``step_accuracy``, ``step_images_per_sec``), on a terminal too.
    """

    def __init__(self, epochs: int, every: str = "", tensorboard: TensorBoard | None = None):
        self.epochs = epochs
        self.interactive = sys.stdout.isatty()
        self.every_steps, self.every_seconds = parse_every(every)
        self.tensorboard = tensorboard
        self._bar = None
        self._bar_time = 0.0
        self._started = 0.0

    def begin(self, epoch: int, steps: int, first_step: int, images_per_step: int = 0) -> None:
        print(f"Epoch {epoch + 1}/{self.epochs}", flush=True)
        self._started = self._last_time = time.perf_counter()
        self._epoch, self._steps, self._first = epoch, steps, first_step
        self._last_step, self._images_per_step = first_step, images_per_step
        if self.interactive:
            from hvd_train.compat import keras

            self._bar = keras.utils.Progbar(steps, stateful_metrics=["loss", "accuracy"])
            if first_step:
                self._bar.update(first_step)

    def step(self, done: int, logs: dict) -> None:
        now = time.perf_counter()
        if self._bar is not None and now - self._bar_time >= BAR_SECONDS:
            # Reading the metrics waits for the device: a few times a second is enough for a bar.
            self._bar.update(done, [(k, float(v)) for k, v in logs.items()])
            self._bar_time = now
        due = (self.every_steps and done - self._last_step >= self.every_steps) or (
            self.every_seconds and now - self._last_time >= self.every_seconds
        )
        if not due or done >= self._steps or (self._bar is not None and self.tensorboard is None):
            return
        values = {k: float(v) for k, v in logs.items() if k in ("loss", "accuracy")}
        rate = (done - self._last_step) * self._images_per_step / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = done, now
        if self._bar is None:
            left = (self._steps - done) * (now - self._started) / max(done - self._first, 1)
            shown = " - ".join(f"{k}: {v:.4f}" for k, v in values.items())
            print(
                f"step {done}/{self._steps} - {rate:.1f} images/s - {shown} - ETA {_duration(left)}",
                flush=True,
            )
        if self.tensorboard is not None:
            self.tensorboard.write_step(self._epoch * self._steps + done, {**values, "images_per_sec": rate})

    def end(self, steps: int, logs: dict) -> None:
        self._bar = None
        shown = " - ".join(
            f"{k}: {v:.4f}"
            for k, v in logs.items()
            if k in ("loss", "accuracy", "f1", "val_loss", "val_accuracy", "val_top5", "val_map", "val_f1")
        )
        print(f"{steps}/{steps} - {time.perf_counter() - self._started:.0f}s - {shown}", flush=True)


def _duration(seconds: float) -> str:
    """``42s``, ``12m05s``, ``3h07m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Reporters:
    """Rank 0's writers of one run."""

    def __init__(self, output: str, epochs: int, tensorboard: bool, title: str = "", log_every: str = ""):
        self.csv = MetricsCSV(os.path.join(output, "metrics.csv"))
        self.curves = os.path.join(output, plots.CURVES)
        self.title = title
        # Drawn off the training thread: a stop request must not wait for matplotlib
        # (plain mpirun kills 1 s after passing SIGTERM on): the checkpoint is written
        # before the loop ends and ``close`` joins the painter. A daemon thread all
        # the same: a process killed mid-draw leaves the previous picture in place.
        # The painter draws the latest rows handed over; epochs count what was
        # handed over and what is drawn, so ``wait`` cannot return early.
        # Between pictures it waits out its share (``PAINT_SHARE``) unless
        # somebody waits for the picture (``wait``, ``close``).
        self._painter = threading.Condition()
        self._latest: list[dict] | None = None
        self._handed = self._drawn = self._waiting = 0
        self.pictures = 0  # drawn so far
        self._closed = False
        self._next = 0.0  # time.monotonic() from which the painter may draw again
        self._thread = threading.Thread(target=self._paint, name="curves", daemon=True)
        self._thread.start()
        self.tensorboard_folder = os.path.join(output, "tensorboard")
        self.tensorboard = TensorBoard(self.tensorboard_folder) if tensorboard else None
        self.progress = Progress(epochs, log_every, self.tensorboard)

    def draw_soon(self, epoch: int, logs: dict) -> None:
        """Hands the curves up to epoch ``epoch`` (0-based) to the painter; never fails.

        Called after the epoch's checkpoint: the picture is drawn while the
        next epoch's steps run, which hand the GIL over a few times a step,
        where a checkpoint hands it over a few times per variable. Epochs
        shorter than the painter's share (``PAINT_SHARE``) are drawn together.
        """
        try:
            rows = self.csv.with_row(epoch + 1, logs)
        except OSError as e:
            log.warning("could not draw %s: cannot read %s (%s)", self.curves, self.csv.path, e.strerror or e)
            return
        with self._painter:
            self._latest = rows
            self._handed += 1
            self._painter.notify_all()

    def epoch_end(self, epoch: int, logs: dict, checkpoint: str = "") -> None:
        """Writes epoch ``epoch`` (0-based) to metrics.csv and TensorBoard (after its checkpoint).

        Raises:
            UserError: a file could not be written (a full disk, no
                permission); ``checkpoint`` (already written) is named, so
                the user knows the run can go on from it.
        """
        try:
            self.csv.write(epoch + 1, logs)
            if self.tensorboard is not None:
                self.tensorboard.write(epoch + 1, logs)
        except OSError as e:
            raise self._write_error(self.csv.path, e.strerror or str(e), checkpoint) from None
        except Exception as e:  # TensorFlow's summary writer raises its own errors
            from hvd_train.compat import tf

            if not isinstance(e, tf.errors.OpError):
                raise
            raise self._write_error(self.tensorboard_folder, first_line(e), checkpoint) from None

    @staticmethod
    def _write_error(path: str, reason: str, checkpoint: str) -> UserError:
        full = any(os.strerror(code) in reason for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
        then = f"Checkpoint {checkpoint} is written: rerun" if checkpoint else "Then rerun"
        return UserError(
            f"cannot write {path} ({reason}); {'free some space' if full else 'check it'} or choose another "
            f"--output. {then} the same command to continue."
        )

    def _paint(self) -> None:
        # matplotlib's import costs ~0.7 s: paid now, while the first epoch
        # traces its graph, not with the first picture.
        self._draw(plots.warm_up)
        while True:
            with self._painter:
                self._painter.wait_for(lambda: self._latest is not None or self._closed)
                if self._latest is None:
                    return  # closed, and nothing left to draw
                self._painter.wait_for(
                    lambda: self._closed or self._waiting or time.monotonic() >= self._next,
                    max(0.0, self._next - time.monotonic()),
                )
                rows, handed, self._latest = self._latest, self._handed, None  # only the latest epochs matter
            self._draw(lambda rows=rows: plots.curves(rows, self.curves, self.title))
            with self._painter:
                self.pictures += 1
                self._drawn = handed
                self._painter.notify_all()

    def _draw(self, plot) -> None:
        """``plot()`` into curves.png, then the time it must leave the steps (``PAINT_SHARE``)."""
        cpu = time.thread_time()
        plots.draw(self.curves, plot)
        self._next = time.monotonic() + (time.thread_time() - cpu) * (1 / PAINT_SHARE - 1)

    def wait(self, timeout: float = 30.0) -> bool:
        """Waits until curves.png shows every epoch written so far (drawn now, whatever its share)."""
        with self._painter:
            self._waiting += 1
            self._painter.notify_all()
            try:
                return self._painter.wait_for(lambda: self._drawn >= self._handed, timeout)
            finally:
                self._waiting -= 1

    def close(self, timeout: float = 30.0) -> None:
        """Ends the painter thread once it has drawn what it was handed.

        It is joined, not left behind: a daemon thread woken while the
        interpreter shuts down can abort the process.
        """
        with self._painter:
            self._closed = True
            self._painter.notify_all()
        self._thread.join(timeout)

    def truncate(self, epochs_done: int, last: dict | None = None) -> None:
        """Drops rows of epochs after ``epochs_done`` (a run that starts over or rolled back).

        Args:
            last: the logs of epoch ``epochs_done`` as its checkpoint recorded
                them, written as its row when the row is missing (the process
                died between the checkpoint and metrics.csv).

        Raises:
            UserError: metrics.csv cannot be read or written.
        """
        try:
            before = self.csv.rows()
            rows = [r for r in before if r.get("epoch", "").isdigit() and int(r["epoch"]) <= epochs_done]
            if last and epochs_done and not any(int(r["epoch"]) == epochs_done for r in rows):
                self.csv.write(epochs_done, last)
            elif len(rows) != len(before) or not os.path.isfile(self.csv.path):
                self.csv.save(rows)
        except OSError as e:
            raise self._write_error(self.csv.path, e.strerror or str(e), "") from None
