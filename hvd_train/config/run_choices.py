"""The run section's options (``run:`` in a YAML file): the output, the epochs, checkpoints, logs, trackers."""

from __future__ import annotations

from dataclasses import dataclass

from hvd_train.config.fields import opt as _opt
from hvd_train.config.fields import renamed as _renamed

EARLY_STOP_METRICS = ("val_accuracy", "val_loss", "val_top5", "val_map", "val_f1")
# --track: none, and the names of the table of trackers (training.tracking.TRACKERS, which a test holds it to).
TRACKERS = ("none", "mlflow", "jsonl")


@dataclass(frozen=True)
class RunConfig:
    """The run itself.

    Attributes:
        output: folder for the model, logs, checkpoints and metrics.
        epochs: number of training epochs.
        early_stop: stop once ``early_stop_metric`` has not improved for
            this many epochs; the best epoch's weights are the saved model
            (its checkpoint is kept). 0: off.
        early_stop_metric: the held-out number watched: ``val_accuracy``,
            ``val_top5`` (higher is better) or ``val_loss`` (lower).
        seed: seed of the split, the shuffles and the augmentation.
        resume: continue from the latest checkpoint in ``output``. False
            (``--no-resume``) starts over; the checkpoints already in
            ``output`` are deleted once training starts (after the data is
            listed and the model built), not before.
        allow_data_change: resume even when the images listed now differ
            from those the checkpoint was made with (its digests); the
            interrupted epoch then starts over. Without it such a resume is
            refused: the rest of the run would map onto other files.
        keep_checkpoints: how many checkpoints to keep (epoch ends and mid-epoch ones together).
        checkpoint_every: also checkpoint inside epochs: every N steps
            (``500``) or every duration (``90s``, ``15m``, ``2h``); empty:
            at epoch ends only.
        deterministic: TensorFlow op determinism: the same run gives
            bit-identical weights, also when interrupted and resumed.
        tensorboard: write TensorBoard logs under ``output/tensorboard``.
        log_every: when the output is not a terminal, a progress line (step,
            images/s, loss, ETA) every N steps (``200``) or every duration
            (``30s``); empty: at epoch ends only. TensorBoard gets the same
            numbers, as ``step_*`` scalars.
        log_all_ranks: every rank logs at INFO, not only rank 0.
        sample_log: folder where every rank appends the ids of the images of
            each step (JSON lines), to audit what was trained on. A step's
            line is written as the step starts, before its allreduce: every
            step that completed is there, and a step cut short by a lost
            worker or a kill may be there too. In an elastic job, ``commit``
            and ``rollback`` lines mark what was kept: a step counts once a
            commit follows it before any rollback.
        track: the tracker rank 0 copies the run to as it goes (its
            parameters, every epoch's metrics, the end): ``mlflow``,
            ``jsonl``; ``none``.
        tracker_uri: where the tracker writes (``track_uri`` before).
        tracker_project: the project of the run (``track_experiment`` before).
        tracker_run: the run's name (``track_run`` before). Each one's help
            says what it is to each tracker.
    """

    output: str = _opt("", "--output", "folder for the model, logs, checkpoints and metrics")
    epochs: int = _opt(10, "--epochs", "number of training epochs")
    early_stop: int = _opt(
        0, "--early-stop", "stop after this many epochs without a better held-out score; save the best (0: off)"
    )
    early_stop_metric: str = _opt(
        "val_accuracy", "--early-stop-metric", "held-out number --early-stop watches", choices=EARLY_STOP_METRICS
    )
    seed: int = _opt(42, "--seed", "seed of the split, the shuffles and the augmentation")
    resume: bool = _opt(
        True,
        "--resume",
        "continue from the latest checkpoint in --output; --no-resume starts over and deletes the checkpoints "
        "in --output once training starts (after the data is listed and the model built)",
    )
    allow_data_change: bool = _opt(
        False,
        "--allow-data-change",
        "resume even when the images differ from those of the checkpoint (the interrupted epoch starts over)",
    )
    keep_checkpoints: int = _opt(2, "--keep-checkpoints", "how many checkpoints to keep")
    checkpoint_every: str = _opt(
        "", "--checkpoint-every", "also checkpoint every N steps or every duration such as 15m (empty: epoch ends)"
    )
    deterministic: bool = _opt(False, "--deterministic", "TensorFlow op determinism: bit-identical reruns and resumes")
    tensorboard: bool = _opt(True, "--tensorboard", "write TensorBoard logs")
    log_every: str = _opt(
        "30s", "--log-every", "progress line in a log file every N steps or every duration (empty: epoch ends only)"
    )
    log_all_ranks: bool = _opt(False, "--log-all-ranks", "every rank logs, not only rank 0")
    sample_log: str = _opt("", "--sample-log", "folder where each rank logs the image ids of every step (audits)")
    track: str = _opt(
        "none",
        "--track",
        "tracker rank 0 copies the run to: mlflow, an MLflow run; jsonl, a file of JSON lines (no server)",
        choices=TRACKERS,
    )
    tracker_uri: str = _opt(
        "",
        "--tracker-uri",
        "where the tracker writes; mlflow: the tracking URI (empty: MLFLOW_TRACKING_URI, else MLflow's own); "
        "jsonl: the file, a path inside --output or an absolute one (empty: tracking.jsonl in --output)",
        **_renamed("track_uri"),
    )
    tracker_project: str = _opt(
        "hvd_train",
        "--tracker-project",
        "the run's project; mlflow: its experiment; jsonl: the project of every event",
        **_renamed("track_experiment"),
    )
    tracker_run: str = _opt(
        "",
        "--tracker-run",
        "the run's name (empty: the --output folder's name); mlflow: its run's; jsonl: the run of every event",
        **_renamed("track_run"),
    )
