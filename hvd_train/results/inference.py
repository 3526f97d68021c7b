"""Loading a finished run's model for evaluation and prediction."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import yaml

from hvd_train.compat import KERAS_MAJOR, keras
from hvd_train.errors import UserError, first_line
from hvd_train.files import read_json, sha256
from hvd_train.model import sharded_files
from hvd_train.model.catalogue import get_spec

# What a finished run leaves for inference, written together (training/finish.py).
MODEL, LABELS, CONFIG = "model.keras", "labels.json", "run_config.yaml"
# A sharded head saved as files (--head-save): the network up to the head, and the head's arrays.
FEATURES, HEAD_ARRAYS = "features.keras", ("kernel", "bias")


def saved_names(folder: str) -> tuple[str, ...]:
    """The files of the model saved in ``folder``: ``model.keras``, or (a sharded head saved as files)
    ``features.keras`` and the head's arrays; then ``labels.json`` and ``run_config.yaml``."""
    if os.path.isfile(os.path.join(folder, MODEL)) or not os.path.isfile(os.path.join(folder, FEATURES)):
        return (MODEL, LABELS, CONFIG)
    return (FEATURES, *(os.path.basename(sharded_files.path_of(folder, n)) for n in HEAD_ARRAYS), LABELS, CONFIG)


def model_files(folder: str) -> dict[str, str]:
    """The SHA-256 of each file of the saved model (``saved_names``) in ``folder``."""
    return {name: sha256(os.path.join(folder, name)) for name in saved_names(folder)}


@dataclass(frozen=True)
class Trained:
    """A trained classifier and what it needs to score images.

    Attributes:
        model: the Keras model (outputs are class probabilities: a softmax, or for a multi-label run a sigmoid
            per class).
        classes: class names, in output order.
        image_size: side of the square input.
        crop_fraction: the evaluation center crop used in training.
        preprocess: the backbone's ``preprocess_input``.
        alpha_background: what transparent pixels were composited over in training.
        head: the folder of the head's arrays when the head was saved as files and is left there
            (``load_trained(sharded=True)``); ``model`` is then the network up to the head.
        data: the run's data options (``run_config.yaml``'s ``data``), for reading held-out data as the run read
            its own.
    """

    model: object
    classes: list[str]
    image_size: int
    crop_fraction: float
    preprocess: object
    alpha_background: str = "white"
    head: str | None = None
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def multi_label(self) -> bool:
        """Whether the run trained a multi-label set: a sigmoid per class, not a softmax."""
        return bool(self.data.get("multi_label"))

    @property
    def label_separator(self) -> str:
        """What split a multi-label run's cells of labels (``--label-separator``; "": spaces)."""
        return str(self.data.get("label_separator") or "")

    def table_options(self, table):
        """``table`` (a ``data.table.TableOptions``) reading labels as the run read them: a multi-label run's
        cells as sets, split by its separator; a single-label run's as they are."""
        if not self.multi_label:
            return table
        return dataclasses.replace(table, multi_label=True, label_separator=self.label_separator)

    @property
    def threshold(self) -> float:
        """A multi-label run's decision: the probability a label needs."""
        return float(self.data.get("threshold", 0.5))

    def decision(self, given: float | None, flag: str = "--threshold", agreed: bool = False) -> float:
        """The threshold ``given`` on the command line, else the run's; refused for a single-label run
        (``agreed``: every rank refuses it alike).

        Raises:
            UserError: a threshold given for a run that is not multi-label, or not a probability in (0, 1).
        """
        if given is None:
            return self.threshold
        if not self.multi_label:
            raise UserError(f"{flag} {given:g} applies to multi-label runs, and this one is not; leave it out.", agreed)
        if not 0.0 < given < 1.0:
            raise UserError(f"{flag} {given:g} is not a probability in (0, 1); give one, e.g. 0.5.", agreed)
        return float(given)


def load_trained(model_dir: str, sharded: bool = False) -> Trained:
    """Loads the model (``saved_names``), ``labels.json`` and ``run_config.yaml`` of a run.

    A head saved as files is attached to the network before it as one
    ordinary model, if this process has the memory for it; with ``sharded``
    it is left in its files, for ranks that each read their columns.

    Raises:
        UserError: the folder is not a finished training run, or its head cannot be held here.
    """
    hint = "--model-dir takes the --output folder of a finished `hvd-train train`"
    names = saved_names(model_dir)
    paths = {name: os.path.join(model_dir, name) for name in names}
    for name, path in paths.items():
        if not os.path.isfile(path):
            raise UserError(f"{model_dir} has no {name}; {hint}.")
    _check_written_together(model_dir)
    with open(paths[LABELS], encoding="utf-8") as f:
        classes = json.load(f)
    with open(paths[CONFIG], encoding="utf-8") as f:
        run_config = yaml.safe_load(f)
    _check_keras_major(paths[names[0]])
    try:
        model = keras.models.load_model(paths[names[0]], compile=False)
    except Exception as e:  # a truncated or foreign file; Keras raises many types
        raise UserError(f"cannot load {paths[names[0]]} ({first_line(e, limit=200)}); {hint}.") from None
    head = None
    if names[0] == FEATURES:
        _check_head(model_dir, len(classes))
        head = model_dir if sharded else None
        if not sharded:
            model = whole_model(model, model_dir, len(classes))
    elif len(classes) != int(model.output_shape[-1]):
        raise UserError(
            f"{paths[LABELS]} names {len(classes)} classes but {paths[MODEL]} has {int(model.output_shape[-1])} "
            f"outputs: they are not of the same run; train again into {model_dir} to write them together."
        )
    spec = get_spec(run_config["model"]["name"])
    return Trained(
        model=model,
        classes=list(classes),
        image_size=int(model.input_shape[1]),
        crop_fraction=float(run_config["data"]["crop_fraction"]),
        preprocess=spec.preprocess_input(),
        alpha_background=str(run_config["data"].get("alpha_background", "white")),
        head=head,
        data=dict(run_config["data"]),
    )


def saved_keras_major(path: str) -> int | None:
    """The Keras major that wrote the ``.keras`` file at ``path`` (its ``metadata.json``); None if unreadable."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            version = str(json.loads(archive.read("metadata.json")).get("keras_version", ""))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    return int(version.split(".")[0]) if version.split(".")[0].isdigit() else None


def _check_keras_major(path: str) -> None:
    """Refuses a ``.keras`` file of the other Keras major in one line (``.keras`` files do not cross majors)."""
    written = saved_keras_major(path)
    if written is not None and written != KERAS_MAJOR:
        raise UserError(
            f"{path} was saved by Keras {written}, and this process runs Keras {KERAS_MAJOR} (.keras files do not "
            f"load across Keras majors): run with HVD_TRAIN_KERAS={written}"
        )


def whole_model(features, folder: str, classes: int):
    """The ordinary model: ``features`` (the network up to the head) and the head read from ``folder``.

    Raises:
        UserError: the whole model needs more memory than this process has.
    """

    from hvd_train.distributed import memory
    from hvd_train.model.catalogue import HEAD_LAYER

    width = int(features.output_shape[-1])
    needed = 4 * ((width + 1) * classes + features.count_params())
    room = memory.room()
    if needed > room.bytes:
        raise UserError(
            f"the model in {folder} holds a head of {classes} classes saved as files, {needed / 2**30:.1f} GiB whole, "
            f"and this process has room for {room}: score it with the head sharded over N processes "
            f"(horovodrun -np N hvd-train evaluate --model-dir {folder} ...), each holding 1/N of it, "
            "or use a host with more memory."
        )
    outputs = keras.layers.Dense(classes, activation="softmax", dtype="float32", name=HEAD_LAYER)(features.output)
    model = keras.Model(features.inputs, outputs, name=features.name)
    sharded_files.load_whole(model.get_layer(HEAD_LAYER), folder)
    return model


def _check_head(model_dir: str, classes: int) -> None:
    """Refuses head arrays that cannot be read, or that hold another number of classes than the labels."""
    import numpy as np

    for name in HEAD_ARRAYS:
        path = sharded_files.path_of(model_dir, name)
        try:
            found = np.load(path, mmap_mode="r").shape[-1]
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {path} ({e}); train again into {model_dir} to write it again.") from None
        if found != classes:
            raise UserError(
                f"{os.path.join(model_dir, LABELS)} names {classes} classes but {path} holds {found}: they are not "
                f"of the same run; train again into {model_dir} to write them together."
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
            f"with the model (summary.json records other digests): the files are of different runs or were "
            f"edited; train again into {model_dir} (the same command resumes and writes them together)."
        )
