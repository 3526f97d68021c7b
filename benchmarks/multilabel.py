"""A multi-label set end to end: the demo's images, each labelled with its pattern and, for the stripes, ``stripes``.

Trains the demo's recipe with ``--multi-label`` under ``horovodrun -np 2``,
then scores the held-out images three ways:

* ``hvd-train evaluate`` as one process and under ``horovodrun -np 2``
  (each rank half of the images): the same counts and average precisions,
  to the bit, as the run's own ``summary.json``;
* scikit-learn's ``average_precision_score`` and ``precision_recall_fscore_support``
  on the saved model's scores of the same images, in one process: the
  reference the exact sums across ranks are held to.

    python benchmarks/multilabel.py [--images-per-class 200] [--epochs 12]

Prints a Markdown table; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HVD_TRAIN = [sys.executable, "-m", "hvd_train"]


def run(args: list, np_: int = 1) -> float:
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")  # the environment's own
    horovodrun = beside if os.path.exists(beside) else "horovodrun"
    launcher = [horovodrun, "--gloo", "-np", str(np_), "-H", f"localhost:{np_}"] if np_ > 1 else []
    started = time.perf_counter()
    proc = subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images-per-class", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--folder", default="", help="where to work (default: a temporary folder)")
    args = parser.parse_args()

    from hvd_train.commands.demo import DEMO_OPTIONS
    from hvd_train.demo import make_demo_data

    work = Path(args.folder or tempfile.mkdtemp(prefix="multilabel-"))
    data = work / "data"
    if not data.is_dir():
        make_demo_data(str(data), per_class=args.images_per_class)
    images = sorted(p.relative_to(data).as_posix() for p in data.rglob("*") if p.suffix in (".png", ".jpg"))

    def labels(rel: str) -> str:
        pattern = rel.split("/")[0]
        return f"{pattern} stripes" if pattern.startswith("stripes") else pattern

    (work / "tags.csv").write_text("path,labels\n" + "".join(f"{r},{labels(r)}\n" for r in images))
    options = [*DEMO_OPTIONS, "--image-root", data, "--multi-label", "--no-resume"]
    options[options.index("--epochs") + 1] = str(args.epochs)
    out = work / "run"
    seconds = run([*HVD_TRAIN, "train", "--data", work / "tags.csv", "--output", out, *options], np_=2)
    summary = json.loads((out / "summary.json").read_text())

    # The held-out images as a CSV of their own, scored again by evaluate on one rank and on two.
    held, scores = held_out_scores(work, data, out, options)
    (work / "held.csv").write_text("path,labels\n" + "".join(f"{r},{labels(r)}\n" for r in held))
    reports = {}
    for np_ in (1, 2):
        report = work / f"evaluate-{np_}.json"
        evaluate = ["evaluate", "--model-dir", out, "--data", work / "held.csv", "--image-root", data]
        reports[np_] = (run([*HVD_TRAIN, *evaluate, "--report", report], np_=np_), json.loads(report.read_text()))
    one, two = reports[1][1], reports[2][1]
    same = all(one[k] == two[k] for k in ("images", "map", "f1", "precision", "recall", "per_class"))
    same_as_run = (one["map"], one["f1"], one["per_class"]) == (
        summary["val_map"],
        summary["val_f1"],
        summary["val_per_class"],
    )
    classes = json.loads((out / "labels.json").read_text())
    reference = sklearn_scores(scores, held, labels, classes, one["threshold"])
    ap_diff = max(abs(one["per_class"][name]["ap"] - ap) for name, ap in zip(classes, reference["aps"]))

    print(f"\n{len(images)} images, {len(held)} held out; trained {args.epochs} epochs on 2 ranks in {seconds:.0f} s\n")
    print("| | held-out mAP | micro F1 | precision | recall | seconds |")
    print("|---|---|---|---|---|---|")
    print(f"| the run's summary.json | {f4(summary['val_map'])} | {f4(summary['val_f1'])} | "
          f"{f4(summary['val_precision'])} | {f4(summary['val_recall'])} | |")  # fmt: skip
    for np_, (took, r) in reports.items():
        print(f"| evaluate, {np_} rank(s) | {f4(r['map'])} | {f4(r['f1'])} | {f4(r['precision'])} | "
              f"{f4(r['recall'])} | {took:.1f} |")  # fmt: skip
    print(f"| scikit-learn, one process | {f4(reference['map'])} | {f4(reference['f1'])} | "
          f"{f4(reference['precision'])} | {f4(reference['recall'])} | |")  # fmt: skip
    print(f"\nevaluate on 1 and 2 ranks identical: {same}; equal to the run's summary: {same_as_run}")
    tp_alike = reference["counts"] == {n: c["tp"] for n, c in one["per_class"].items()}
    print(f"largest |AP - scikit-learn's AP| over classes: {ap_diff:.1e}; true positives as scikit-learn's: {tp_alike}")
    print("\n| class | positives | precision | recall | F1 | AP |")
    print("|---|---|---|---|---|---|")
    for name, c in one["per_class"].items():
        shown = [c[k] for k in ("precision", "recall", "f1", "ap")]
        print(f"| {name} | {c['positives']} | " + " | ".join("-" if x is None else f"{x:.4f}" for x in shown) + " |")


def f4(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def held_out_scores(work: Path, data: Path, out: Path, options: list):
    """The held-out images (paths relative to ``data``, as the run split them) and the saved model's logits."""
    import numpy as np

    from hvd_train import config
    from hvd_train.compat import keras
    from hvd_train.data.folder import split_per_class
    from hvd_train.data.pipeline import eval_dataset
    from hvd_train.data.table import read_table
    from hvd_train.model.catalogue import HEAD_LAYER, get_spec

    cfg = config.from_sources(None, str(out / "run_config.yaml"))
    listed = read_table(str(work / "tags.csv"), "--data", options=cfg.data.table_options())
    held = split_per_class(listed, cfg.data.val_split, cfg.run.seed)[1]
    model = keras.models.load_model(out / "model.keras", compile=False)
    head = model.get_layer(HEAD_LAYER)
    features = keras.Model(model.inputs, head.input)
    ds = eval_dataset(
        held,
        rank=0,
        size=1,
        batch_size=64,
        image_size=int(model.input_shape[1]),
        crop_fraction=cfg.data.crop_fraction,
        preprocess=get_spec(cfg.model.name).preprocess_input(),
    ).dataset
    import tensorflow as tf

    @tf.function(autograph=False)  # as evaluate computes them (a graph's float32 sums, not eager's)
    def step(images):
        rows = tf.cast(features(images, training=False), tf.float32)
        return tf.matmul(rows, tf.cast(head.kernel, tf.float32)) + tf.cast(head.bias, tf.float32)

    logits = [step(images).numpy() for images, _, _ in ds]
    return [os.path.relpath(p, data) for p in held.paths], np.concatenate(logits)


def sklearn_scores(logits, held: list[str], labels, classes: list[str], threshold: float) -> dict:
    import numpy as np
    from sklearn.metrics import average_precision_score, precision_recall_fscore_support

    truth = np.array([[name in labels(rel).split() for name in classes] for rel in held], np.int8)
    probs = (1 / (1 + np.exp(-logits.astype(np.float32)))).astype(np.float32)
    decided = (probs >= np.float32(threshold)).astype(np.int8)
    aps = [average_precision_score(truth[:, c], logits[:, c]) for c in range(len(classes))]
    precision, recall, f1, _ = precision_recall_fscore_support(truth, decided, average="micro", zero_division=0)
    return {
        "map": float(np.mean(aps)),
        "f1": float(f1),
        "precision": float(precision),
        "recall": float(recall),
        "aps": aps,
        "counts": {name: int((decided[:, c] & truth[:, c]).sum()) for c, name in enumerate(classes)},
    }


if __name__ == "__main__":
    main()
