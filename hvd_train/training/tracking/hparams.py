"""TensorBoard's HParams of a run: its configuration and final numbers, which ``tensorboard --logdir``
over a sweep's folder (or any runs' parent) compares by their options, with no server of ours."""

from __future__ import annotations

import os
import shutil
from typing import Any

from hvd_train.errors import first_line
from hvd_train.log import get_logger
from hvd_train.training.tracking.base import final, flat_config

log = get_logger("track")


def write_hparams(cfg, summary: dict[str, Any]) -> None:
    """TensorBoard's HParams plugin: the resolved configuration and the final numbers, in ``tensorboard/hparams``."""
    from tensorboard.plugins.hparams import api as hp

    from hvd_train.compat import tf

    hparams = {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in flat_config(cfg).items()}
    folder = os.path.join(cfg.run.output, "tensorboard", "hparams")
    try:
        # One session: a resumed run's end replaces the earlier end's.
        shutil.rmtree(folder, ignore_errors=True)
        writer = tf.summary.create_file_writer(folder)
        with writer.as_default():
            hp.hparams(hparams, trial_id=os.path.basename(os.path.abspath(cfg.run.output)))
            for key, value in final(summary).items():
                tf.summary.scalar(f"final/{key}", value, step=0)
        writer.close()
    except Exception as e:  # TensorFlow's own errors (a full disk): the run's files hold it all
        log.warning("could not write TensorBoard's hparams to %s: %s", folder, first_line(e))
