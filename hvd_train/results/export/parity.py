"""``--check``: every file run in its runtime on labelled images, against ``hvd-train predict``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import tf
from hvd_train.results.export.formats import run_savedmodel, run_savedmodel_uint8, runner
from hvd_train.results.export.serving import as_uint8, pixels
from hvd_train.results.inference import Trained
from hvd_train.results.multilabel import decide

# Goals of --check, by quantisation: least top-1 agreement with predict, largest |Δp| (None: not a goal).
GOALS = {"none": (1.0, 1e-4), "float16": (0.995, None), "int8": (0.98, None)}
# A multi-label run's decisions: pairs this close to the threshold may fall either side, by quantisation.
DECISION_BANDS = {"none": 1e-4, "float16": 1e-3, "int8": 2e-2}
INT8_ACCURACY_POINTS = 1.0  # int8 held-out accuracy within this many points of predict's


@dataclass
class Images:
    """Labelled images to check exports on, or unlabelled ones to calibrate int8 with."""

    paths: list[str]
    labels: list[int] | None
    source: str


def parity(
    reference: np.ndarray, probs: np.ndarray, labels: list[int] | None, quantize: str, threshold: float | None = None
) -> dict:
    """Agreement with predict, the largest probability difference, and whether the goals are met.

    A multi-label run's (``threshold``) goal is on its decisions: of the (image, class) pairs that predict or the
    file labels, the share both label, leaving out those within the format's ``DECISION_BANDS`` of the threshold
    (counted as ``decisions_at_the_threshold``: they may fall either side); top-1 agreement is then only
    reported.
    """
    agree = float(np.mean(probs.argmax(1) == reference.argmax(1)))
    delta = float(np.max(np.abs(probs - reference)))
    least, most = GOALS[quantize]
    result = {"images": len(reference), "top1_agreement": agree, "max_abs_diff": delta}
    failed = []
    if not (np.isfinite(probs).all() and np.isfinite(reference).all()):
        failed.append("non-finite probabilities (NaN or inf) from the file or from predict")
    if threshold is not None:
        # Over the pairs either side labels (most pairs are far-off negatives, which would hide flipped labels),
        # but those within the format's band of the threshold, which may fall either side: counted apart.
        ours, theirs = decide(probs, threshold), decide(reference, threshold)
        near = ~(np.abs(np.asarray(reference, np.float64) - threshold) > DECISION_BANDS[quantize])
        judged = (ours | theirs) & ~near
        decided = float(np.mean((ours == theirs)[judged])) if judged.any() else 1.0
        result["decision_agreement"] = decided
        result["decisions_at_the_threshold"] = int(near.sum())
        if decided < least:
            failed.append(f"agreement of decisions at {threshold:g} {decided:.2%} < {least:.1%}")
    elif agree < least:
        failed.append(f"top-1 agreement {agree:.2%} < {least:.1%}")
    if most is not None and delta > most:
        failed.append(f"max |Δp| {delta:.2e} > {most:.0e}")
    if labels is not None:
        truth = np.asarray(labels)
        result["accuracy"] = float(np.mean(probs.argmax(1) == truth))
        result["predict_accuracy"] = float(np.mean(reference.argmax(1) == truth))
        points = 100 * (result["predict_accuracy"] - result["accuracy"])
        if quantize == "int8" and points > INT8_ACCURACY_POINTS:
            failed.append(
                f"held-out accuracy {points:.1f} points below predict's (goal: within {INT8_ACCURACY_POINTS:g})"
            )
    result["passed"] = not failed
    result["failed"] = failed
    return result


def check_folder(folder: str, trained: Trained, manifest: dict, images: Images) -> dict:
    """Runs every export of ``folder`` in its runtime on ``images``, against predict's probabilities.

    The SavedModel gets the image files, as predict does. TFLite and ONNX get
    each image cut to size as uint8, their input contract; predict keeps the
    resized pixels in float, so their reference is predict's model on those
    same 8-bit pixels, and what the rounding alone moves is reported apart
    (``rounding_max_abs_diff``): it is the input's, not the file's.
    """
    threshold = trained.threshold if trained.multi_label else None
    cut = pixels(trained, images.paths)
    uint8 = as_uint8(cut)

    def predict(batch):
        return trained.model.predict(trained.preprocess(tf.constant(batch, tf.float32)), verbose=0, batch_size=32)

    reference, reference_uint8 = predict(cut), predict(uint8)
    rounding = float(np.max(np.abs(reference_uint8 - reference)))
    results = []
    for entry in manifest["formats"]:
        path = os.path.join(folder, entry["path"])
        if entry["format"] == "savedmodel":
            saved = tf.saved_model.load(path)  # once, for both signatures
            result = parity(reference, run_savedmodel(saved, images.paths), images.labels, entry["quantize"], threshold)
            # serving_uint8 gets the whole decoded pixels. Where predict decodes a large JPEG at a
            # reduced scale in the DCT, the signature shrinks the pixels by a box average: close, not
            # the same numbers, so it is held to the top class, as float16 files are.
            probs = run_savedmodel_uint8(saved, images.paths, trained.alpha_background)
            pixels_in = result["serving_uint8"] = parity(reference, probs, images.labels, "float16", threshold)
            pixels_in["input"] = "uint8 pixels of the whole images"
            if not pixels_in["passed"]:
                result["passed"] = False
                result["failed"] += [f"serving_uint8: {why}" for why in pixels_in["failed"]]
        else:
            probs = runner(entry["format"], path)(uint8)
            result = parity(reference_uint8, probs, images.labels, entry["quantize"], threshold)
            result["input"] = "uint8 pixels of the images cut to size"
            result["rounding_max_abs_diff"] = rounding
        result["name"] = f"{entry['format']}{'' if entry['quantize'] == 'none' else ' ' + entry['quantize']}"
        results.append(result)
    return {"images": len(images.paths), "source": images.source, "formats": results}
