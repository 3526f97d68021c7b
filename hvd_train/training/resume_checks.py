"""The checks a resume passes before it takes a checkpoint (rank 0): the same recipe, the same images."""

from __future__ import annotations

from hvd_train.compat import KERAS_MAJOR
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.training import checkpoints
from hvd_train.training.job import Job

log = get_logger("train")


def same_recipe(job: Job, found: checkpoints.Found) -> None:
    """Refuses a resume whose Keras, ``--seed``, ``--grad-accum`` or ``--multi-label`` differs from the
    checkpoint's, or with ``--ema`` from a checkpoint without (rank 0).

    The rest of the interrupted epoch is dealt by the checkpoint's seed, in
    whole updates of its accumulation: a new value would mix two data orders,
    or resume an update half accumulated under another count.
    """
    cfg = job.cfg
    # A checkpoint of before the Keras was recorded is Keras 2's (tf-keras, the default then).
    written = found.info.get("keras", 2)
    if str(written) != str(KERAS_MAJOR):
        which = f"Keras {written}"
        if "keras" not in found.info:
            which = "tf-keras (Keras 2, hvd_train's default before Keras 3)"
        raise UserError(
            f"checkpoint {found.path} was written under {which}, and this run is Keras {KERAS_MAJOR} "
            f"(whose variables are named otherwise): resume with HVD_TRAIN_KERAS={written}, or start over in "
            f"another --output (--no-resume would delete these checkpoints)"
        )
    options = (("seed", found.state.seed, cfg.run.seed), ("grad-accum", found.state.accum, cfg.horovod.grad_accum))
    differ = [f"--{flag} {then} then, {now} now" for flag, then, now in options if then != now]
    if differ:
        same = " ".join(f"--{flag} {then}" for flag, then, _ in options)
        raise UserError(
            f"checkpoint {found.path} was made with other options ({'; '.join(differ)}): the resumed run would "
            f"deal its images and updates otherwise than the run it continues. Give {same} to resume, or "
            f"--no-resume to start over."
        )
    # A checkpoint of before multi-label sets is a single-label run's.
    was = bool(found.info.get("multi_label"))
    if was != cfg.data.multi_label:
        kinds = ("a single-label run (a softmax head)", "a multi-label run (a sigmoid head)")
        raise UserError(
            f"checkpoint {found.path} is of {kinds[was]}, and this run is {kinds[not was].split(' (')[0]}: resume "
            f"it {'with' if was else 'without'} --multi-label, or train this one in another --output "
            f"(--no-resume would delete these checkpoints)."
        )
    if cfg.optim.ema and not found.info.get("ema"):
        raise UserError(
            f"checkpoint {found.path} holds no moving average of the weights (its run had no --ema): resume "
            f"without --ema {cfg.optim.ema}, or pass --no-resume to start over with it."
        )


def same_data(job: Job, found: checkpoints.Found) -> bool:
    """Compares the image lists with the ones ``found`` was made with (rank 0).

    Returns:
        Whether the training images changed (resumed with ``--allow-data-change``).

    Raises:
        UserError: the images differ and ``--allow-data-change`` is not given.
    """
    saved, now = found.info.get("data"), job.data_identity()
    if not saved:
        log.warning(
            "checkpoint %s holds no digest of its image list (written by an older hvd_train): "
            "the images cannot be checked against it",
            found.path,
        )
        return found.state.total != now["train_images"]
    differ = [
        f"{what}: {saved[key + '_images']} images, digest {saved[key]} then; "
        f"{now[key + '_images']} images, digest {now[key]} now"
        for key, what in (("train", "training images"), ("val", "held-out images"))
        if saved.get(key) != now[key]
    ]
    if not differ:
        return False
    if not job.cfg.run.allow_data_change:
        raise UserError(
            f"the images differ from those checkpoint {found.path} was made with ({'; '.join(differ)}): resuming "
            f"would map the rest of the run onto other files (and could hold out images already trained on). "
            f"Give the same images (--data, --val-data, --val-split, --seed), pass --allow-data-change to resume "
            f"anyway (the interrupted epoch starts over), or --no-resume to start over."
        )
    log.warning(
        "--allow-data-change: the images differ from those of checkpoint %s (%s)%s",
        found.path,
        "; ".join(differ),
        "; the interrupted epoch starts over" if saved.get("train") != now["train"] else "",
    )
    return saved.get("train") != now["train"]
