"""Loading a finished run's model for evaluation and prediction."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import yaml

from hvd_train.compat import keras
from hvd_train.errors import UserError
from hvd_train.files import read_json, sha256
from hvd_train.model.catalogue import get_spec

# What a finished run leaves for inference, written together (training/finish.py).
MODEL, LABELS, CONFIG = "model.keras", "labels.json", "run_config.yaml"


def model_files(folder: str) -> dict[str, str]:
    """The SHA-256 of ``model.keras``, ``labels.json`` and ``run_config.yaml`` in ``folder``."""
    return {name: sha256(os.path.join(folder, name)) for name in (MODEL, LABELS, CONFIG)}


@dataclass(frozen=True)
class Trained:
    """A trained classifier and what it needs to score images.

    Attributes:
        model: the Keras model (outputs are class probabilities).
        classes: class names, in output order.
        image_size: side of the square input.
        crop_fraction: the evaluation center crop used in training.
        preprocess: the backbone's ``preprocess_input``.
        alpha_background: what transparent pixels were composited over in training.
    """

    model: object
    classes: list[str]
    image_size: int
    crop_fraction: float
    preprocess: object
    alpha_background: str = "white"


def load_trained(model_dir: str) -> Trained:
    """Loads ``model.keras``, ``labels.json`` and ``run_config.yaml`` of a run.

    Raises:
        UserError: the folder is not a finished training run.
    """
    hint = "--model-dir takes the --output folder of a finished `hvd-train train`"
    paths = {name: os.path.join(model_dir, name) for name in (MODEL, LABELS, CONFIG)}
    for name, path in paths.items():
        if not os.path.isfile(path):
            raise UserError(f"{model_dir} has no {name}; {hint}.")
    _check_written_together(model_dir)
    with open(paths[LABELS], encoding="utf-8") as f:
        classes = json.load(f)
    with open(paths[CONFIG], encoding="utf-8") as f:
        run_config = yaml.safe_load(f)
    try:
        model = keras.models.load_model(paths[MODEL], compile=False)
    except Exception as e:  # a truncated or foreign file; Keras raises many types
        raise UserError(f"cannot load {paths[MODEL]} ({str(e).splitlines()[0][:200]}); {hint}.") from None
    outputs = int(model.output_shape[-1])
    if len(classes) != outputs:
        raise UserError(
            f"{paths[LABELS]} names {len(classes)} classes but {paths[MODEL]} has {outputs} outputs: "
            f"they are not of the same run; train again into {model_dir} to write them together."
        )
    spec = get_spec(run_config["model"]["name"])
    return Trained(
        model=model,
        classes=list(classes),
        image_size=int(model.input_shape[1]),
        crop_fraction=float(run_config["data"]["crop_fraction"]),
        preprocess=spec.preprocess_input(),
        alpha_background=str(run_config["data"].get("alpha_background", "white")),
    )


def _check_written_together(model_dir: str) -> None:
    """Refuses a model whose labels or configuration are not the ones its run wrote with it.

    ``summary.json`` records the SHA-256 of the three files as the run wrote
    them (``model_files``); a run folder of an older hvd_train has none.
    """
    recorded = (read_json(os.path.join(model_dir, "summary.json"), {}) or {}).get("model_files")
    if not isinstance(recorded, dict):
        return
    changed = [name for name, digest in model_files(model_dir).items() if recorded.get(name, digest) != digest]
    if changed:
        raise UserError(
            f"{' and '.join(changed)} in {model_dir} {'is' if len(changed) == 1 else 'are'} not what its run wrote "
            f"with model.keras (summary.json records other digests): the files are of different runs or were "
            f"edited; train again into {model_dir} (the same command resumes and writes them together)."
        )
