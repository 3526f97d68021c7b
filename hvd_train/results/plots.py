"""Pictures of a run: training curves, the confusion matrix, the learning-rate range test.

Drawn with matplotlib's Agg backend (no display needed) through its
object-oriented API, so nothing touches pyplot's global state. Every
picture is written to a temporary file and renamed into place: a reader
(a browser refreshing ``curves.png`` mid-run) never sees half an image.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from hvd_train import files
from hvd_train.log import get_logger
from hvd_train.results.confusion import Confusion

log = get_logger("plots")

CURVES = "curves.png"
CONFUSION = "confusion.png"
LR_FIND = "lr_find.png"


def draw(path: str, plot: Callable[[], None]) -> bool:
    """Draws the picture ``path`` with ``plot()``; a failure is a warning, never the end of a run."""
    try:
        plot()
        return True
    except Exception as e:  # matplotlib raises many types (fonts, memory, disk)
        log.warning("could not draw %s: %s", path, e)
        return False


def warm_up() -> None:
    """Imports matplotlib and renders a line of text (its font), without drawing a whole picture."""
    fig = figure(1, 1)
    fig.text(0.5, 0.5, "0.5")
    fig.savefig(io.BytesIO(), format="png", dpi=10)


def figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, path, dpi: int = 100) -> None:
    """Writes ``fig`` as PNG to the file ``path`` (atomically) or to a binary file object."""
    if not isinstance(path, str | os.PathLike):
        fig.savefig(path, format="png", dpi=dpi)
        return
    with files.replacing(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)


def _column(rows: Sequence[dict], key: str) -> np.ndarray:
    """The values of ``key``, NaN where a row has none."""
    values = []
    for row in rows:
        text = row.get(key, "")
        values.append(float(text) if text not in ("", None) else math.nan)
    return np.asarray(values, dtype=float)


def curves(rows: Sequence[dict], path: str, title: str = "") -> None:
    """``curves.png``: loss, accuracy (training; held-out top-1 and top-5) or a multi-label run's F1 (training;
    held-out) and mAP, learning rate and images/s per epoch.

    Args:
        rows: the rows of ``metrics.csv`` (strings, as ``csv.DictReader`` gives them).
    """
    epochs = _column(rows, "epoch")
    fig = figure(11, 7)
    if title:
        fig.suptitle(title)
    axes = fig.subplots(2, 2)
    scores = (("accuracy", "training top-1"), ("val_accuracy", "held-out top-1"), ("val_top5", "held-out top-5"))
    if any(row.get("val_map") for row in rows):  # a multi-label run's scores
        scores = (("f1", "training F1 (micro)"), ("val_map", "held-out mAP"), ("val_f1", "held-out F1 (micro)"))
    panels = (
        (axes[0, 0], "loss", (("loss", "training"), ("val_loss", "held-out")), False),
        (axes[0, 1], "accuracy" if scores[0][0] == "accuracy" else "mAP and F1", scores, False),
        (axes[1, 0], "learning rate (end of epoch)", (("lr", "learning rate"),), True),
        (axes[1, 1], "images/s (all workers)", (("images_per_sec", "images/s"),), False),
    )
    for ax, name, series, log_scale in panels:
        drawn = False
        for key, label in series:
            values = _column(rows, key)
            if key == "val_top5" and np.all(values[np.isfinite(values)] == 1.0):
                continue  # five classes or fewer: top-5 is always right, and says nothing
            if np.isfinite(values).any():
                ax.plot(epochs, values, marker="o", markersize=3, label=label)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif log_scale and np.nanmin(_column(rows, series[0][0])) > 0:
            ax.set_yscale("log")
        if name in ("accuracy", "mAP and F1"):
            ax.set_ylim(0, 1.02)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        if len(series) > 1 and drawn:
            ax.legend()
        if len(epochs):
            ax.set_xlim(0.5, max(epochs.max(), 1) + 0.5)
            ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, path)


MANY_CLASSES = 100
"""Above this many classes a confusion matrix is no picture: the most confused pairs and worst classes are."""


def confusion_to_json(confusion: Confusion):
    """The confusion as JSON: rows of counts, or above ``MANY_CLASSES`` classes only its non-zero cells.

    A dense 1,000-class matrix is a million numbers (megabytes of JSON) for
    at most as many non-zero cells as held-out images. Images with no
    predicted class (scores not finite) have no column in the rows: the cells
    keep them (predicted class -1), whatever the classes.
    """
    if confusion.classes <= MANY_CLASSES and not confusion.unanswered():
        return confusion.dense().tolist()
    return {"classes": confusion.classes, "cells": confusion.cells()}


def confusion_from_json(value) -> Confusion:
    """The confusion ``confusion_to_json`` wrote (either form)."""
    if isinstance(value, dict):
        cells = np.asarray(value["cells"], np.int64).reshape(-1, 3)
        return Confusion(int(value["classes"]), cells[:, 0], cells[:, 1], cells[:, 2])
    return Confusion.of_dense(value)


def most_confused(confusion: Confusion, classes: Sequence[str], top: int = 25) -> list[tuple[str, str, int, float]]:
    """The ``top`` largest off-diagonal cells: ``(true class, predicted class, images, share of the true class)``."""
    totals = confusion.totals()
    return [(classes[t], classes[p], n, float(n / totals[t])) for t, p, n in confusion.mistakes(top)]


def confusion(matrix: Confusion, classes: Sequence[str], path: str, title: str = "") -> None:
    """``confusion.png``: rows are true classes, columns predictions, colour the share of each row.

    Readable from 2 to ``MANY_CLASSES`` classes: the figure grows with the
    classes, counts are written in the cells while they fit, long names are
    shortened. Above that (ImageNet's 1,000) the matrix would be a million
    cells of a few pixels each, so the picture shows the most confused
    pairs and the classes with the lowest accuracy instead.
    """
    n = len(classes)
    if n > MANY_CLASSES:
        _confusion_of_many(matrix, classes, path, title)
        return
    correct, count, unanswered = matrix.trace(), matrix.sum(), matrix.unanswered()
    totals = matrix.totals()[:, None]  # images with no predicted class among them: no cell of their row
    matrix = matrix.dense()
    share = np.divide(matrix, totals, out=np.zeros(matrix.shape, dtype=float), where=totals > 0)
    cell = 0.42 if n <= 20 else 0.2  # inches per class
    names = [c if len(c) <= 28 else c[:27] + "…" for c in classes]
    margin = 1.5 + 0.075 * max((len(c) for c in names), default=4)
    side = max(5.0, n * cell + margin)
    fig = figure(side + 1.2, side)
    ax = fig.add_subplot()
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.04, label="share of the true class")
    font = 9 if n <= 20 else max(5, 9 - n // 40)
    ax.set_xticks(range(n), names, rotation=90, fontsize=font)
    ax.set_yticks(range(n), names, fontsize=font)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if n <= 30:
        for t in range(n):
            for p in range(n):
                if matrix[t, p]:
                    dark = share[t, p] > 0.55
                    ax.text(
                        p,
                        t,
                        str(matrix[t, p]),
                        ha="center",
                        va="center",
                        fontsize=font - 1,
                        color="white" if dark else "black",
                    )
    heading = f"{title + ': ' if title else ''}{correct}/{count} right ({correct / max(count, 1):.1%})"
    ax.set_title(heading + (f", {unanswered} with no class (scores not finite)" if unanswered else ""))
    save(fig, path, dpi=100)


def _confusion_of_many(matrix: Confusion, classes: Sequence[str], path: str, title: str, top: int = 25) -> None:
    names = [c if len(c) <= 28 else c[:27] + "…" for c in classes]
    pairs = most_confused(matrix, names, top)
    totals, hits = matrix.totals(), matrix.right()
    accuracy = np.divide(hits, totals, out=np.ones(len(classes)), where=totals > 0)
    worst = [c for c in np.argsort(accuracy, kind="stable") if totals[c] > 0][:top]
    fig = figure(14, 0.3 * top + 2)
    left, right = fig.subplots(1, 2)
    labels = [f"{t} → {p}" for t, p, _, _ in pairs]
    left.barh(range(len(pairs)), [share for *_, share in pairs], color="#c0504d")
    left.set_yticks(range(len(pairs)), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("share of the true class taken for the other")
    left.set_title(f"the {len(pairs)} most confused pairs (true → predicted)")
    for i, (_, _, count, share) in enumerate(pairs):
        left.text(share, i, f" {count}", va="center", fontsize=7)
    right.barh(range(len(worst)), accuracy[worst], color="#4f81bd")
    right.set_yticks(range(len(worst)), [names[c] for c in worst], fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, 1)
    right.set_xlabel("accuracy")
    right.set_title(f"the {len(worst)} classes with the lowest accuracy")
    for i, c in enumerate(worst):
        right.text(accuracy[c], i, f" {int(hits[c])}/{int(totals[c])}", va="center", fontsize=7)
    correct, count = matrix.trace(), matrix.sum()
    fig.suptitle(
        f"{title + ': ' if title else ''}{correct}/{count} right ({correct / max(count, 1):.1%}), "
        f"{len(classes)} classes"
    )
    save(fig, path, dpi=100)


def lr_find(
    lrs: Sequence[float], losses: Sequence[float], smoothed: Sequence[float], suggestion: float | None, path: str
) -> None:
    """``lr_find.png``: loss against learning rate (log scale), with the suggested rate marked."""
    fig = figure(8, 5)
    ax = fig.add_subplot()
    ax.plot(lrs, losses, color="lightgray", label="loss of each step")
    ax.plot(lrs, smoothed, color="C0", label="centred moving average")
    if suggestion:
        ax.axvline(suggestion, color="C3", linestyle="--", label=f"suggested base lr {suggestion:.3g}")
    finite = np.asarray(smoothed, dtype=float)
    finite = finite[np.isfinite(finite)]
    if finite.size:
        low, high = finite.min(), finite[: max(1, finite.size // 10)].mean()
        ax.set_ylim(low - 0.1 * abs(high - low) - 1e-3, high + 1.5 * abs(high - low) + 1e-3)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate of one worker")
    ax.set_ylabel("training loss")
    ax.set_title("learning-rate range test")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, path)
