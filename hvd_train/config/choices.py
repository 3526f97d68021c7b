"""What the user chose: one frozen dataclass per concern, each field with its flag and help.

Each field carries its command-line flag and help text in its metadata, so
the parser, the YAML keys and the validation messages cannot drift apart
(``config.sources`` reads flags and YAML into these; ``config.checks``
validates them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from hvd_train.config.fields import opt as _opt
from hvd_train.config.run_choices import RunConfig
from hvd_train.data.features import IMAGE_KEY, LABEL_KEY, RecordOptions
from hvd_train.data.storage import S3Options, redact_url
from hvd_train.data.table import TableOptions

AUGMENTATIONS = ("crop,flip", "crop", "flip", "none", "randaugment")
BN_MODES = ("auto", "inference", "train")
HEAD_NORMS = ("auto", "layer", "none")
LR_SCHEDULES = ("cosine", "step", "constant")
OPTIMIZERS = ("sgd", "adam", "adamw")
# AdamW's weight decay when none is given: Keras's own (``keras.optimizers.AdamW()``), the optimizer
# built here; PyTorch's AdamW takes 0.01, timm's train.py 2e-5 (docs/training.md, "AdamW").
ADAMW_WEIGHT_DECAY = 0.004
CLASS_WEIGHTS = ("none", "auto")
BAD_IMAGE_POLICIES = ("skip", "fail")
IMAGE_CHECKS = ("quick", "full", "none")  # data.sources
S3_RETRY_MODES = ("standard", "adaptive")
ELASTIC_BATCH = ("keep-worker-batch", "keep-global-batch")
HEAD_SAVES = ("auto", "whole", "files")
AUTOTUNE_LOG = "horovod_autotune.csv"
TIMELINE = "horovod_timeline.json"
PRECISIONS = ("auto", "fp32", "mixed_float16", "mixed_bfloat16")
XLA_MODES = ("off", "auto", "jit")
ALPHA_BACKGROUNDS = ("white", "black", "gray")  # data.images.ALPHA_BACKGROUNDS
MODEL_HELP = (
    "a keras.applications model: ResNet50, resnet50, mobilenet_v2, EfficientNetB0, efficientnet-b0, ... "
    "(case, '_' and '-' ignored; `hvd-train models` lists them all), or a backbone of your own: "
    "FILE.py:FUNCTION or MODULE:FUNCTION (docs/training.md)"
)


# The default of --steps-per-call (benchmarks/RESULTS.md, "Steps per call").
STEPS_PER_CALL = 4


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how they are fed.

    Attributes:
        train: folder tree ``<class>/.../<image>`` to train on, or a CSV of
            image paths and labels (``data.table``).
        val: folder tree or CSV of held-out images; when empty, ``val_split``
            of each class of ``train`` is held out instead.
        image_root, path_column, label_column, min_images_per_label: how a
            CSV is read (``data.table.TableOptions``).
        val_split: fraction of each class held out when ``val`` is not given.
        image_size: side of the square model input; 0 uses the model's default.
        batch_size: images per worker per step.
        augment: training augmentation: ``crop,flip``, ``crop``, ``flip``,
            ``none``, or ``randaugment`` (the crop and flip, then two
            RandAugment operations, see ``data.randaugment``).
        augment_magnitude: RandAugment's magnitude, 0 to 10 (timm's
            ``rand-m9`` is 9).
        crop_fraction: central fraction kept by the evaluation center crop.
        on_bad_image: ``skip`` unreadable images (and list them) or ``fail``.
        check_images: what is checked before the first step: ``quick`` (each
            file's signature and ends; only suspects are decoded), ``full``
            (every image decoded once, the result cached per file), or
            ``none``. Whatever slips through is met in training, given no
            weight and listed.
        alpha_background: what transparent pixels are composited over
            (``white``, ``black``, ``gray``) before anything else.
        mixup: alpha of mixup (Zhang et al.): each training image is blended
            with another of its batch by a factor drawn from Beta(alpha,
            alpha), and its target likewise; 0: off.
        cutmix: alpha of CutMix (Yun et al.): a box of another image of the
            batch is pasted in, the targets mixed by area; 0: off. With both,
            each step does one or the other, evenly.
        s3_endpoint: URL of an S3-compatible store; empty: ``AWS_ENDPOINT_URL`` or AWS.
        s3_concurrency: S3 requests in flight per worker.
        s3_retry_mode: boto3's ``standard`` or ``adaptive`` retries.
        s3_max_attempts: attempts per S3 request, the first included.

    ``train`` and ``val`` may be local folders, ``s3://bucket/prefix/``
    folders, or shard sets made by ``hvd-train pack`` (local or S3).
    """

    train: str = _opt(
        "",
        "--data",
        "image folder tree (labels = folder names), CSV of labels, shard set or TFRecord files to train on, "
        "local or s3://",
    )
    val: str = _opt(
        "",
        "--val-data",
        "image folder tree, CSV of labels, shard set or TFRecord files of held-out images, local or s3://",
    )
    image_root: str = _opt(
        "", "--image-root", "folder or s3:// prefix the image paths of a CSV are relative to (default: its folder)"
    )
    path_column: str = _opt("", "--path-column", "a CSV's column of image paths (default: path, file, image, id, ...)")
    label_column: str = _opt("", "--label-column", "a CSV's column of labels (default: label, class, category, ...)")
    split_column: str = _opt("", "--split-column", "a CSV's column of splits (default: split, subset, partition)")
    multi_label: bool = _opt(False, "--multi-label", "a CSV's images each have a set of labels: a sigmoid head")
    label_separator: str = _opt("", "--label-separator", "what splits a multi-label CSV's labels (default: spaces)")
    threshold: float = _opt(0.5, "--threshold", "a multi-label decision: the probability a label needs")
    min_images_per_label: int = _opt(
        2, "--min-images-per-label", "fewest images a label of a training CSV may have (fewer: a typo, mostly)"
    )
    record_image_key: str = _opt(IMAGE_KEY, "--record-image-key", "other tools' TFRecords: the encoded image's feature")
    record_label_key: str = _opt(
        LABEL_KEY, "--record-label-key", "other tools' TFRecords: the label's feature (an integer or a string)"
    )
    label_offset: int = _opt(0, "--label-offset", "other tools' TFRecords: subtracted from integer labels (1: 1-based)")
    class_names: str = _opt(
        "", "--class-names", "other tools' TFRecords: a text file of class names, one a line, in label order"
    )
    data_split: str = _opt("", "--data-split", "a TFDS folder's split or a CSV's rows to train on (default: train)")
    val_data_split: str = _opt(
        "", "--val-data-split", "a TFDS folder's split or a CSV's rows to hold out (default: validation, else test)"
    )
    val_split: float = _opt(0.1, "--val-split", "fraction of each class held out when --val-data is not given")
    image_size: int = _opt(0, "--image-size", "side of the square model input in pixels (0: the model's default)")
    batch_size: int = _opt(32, "--batch-size", "images per worker per step (the global batch is this x workers)")
    augment: str = _opt("crop,flip", "--augment", "training augmentation", choices=AUGMENTATIONS)
    augment_magnitude: float = _opt(
        9.0, "--augment-magnitude", "RandAugment's magnitude, 0 to 10 (--augment randaugment)"
    )
    crop_fraction: float = _opt(0.875, "--crop-fraction", "central fraction kept by the evaluation crop")
    on_bad_image: str = _opt("skip", "--on-bad-image", "what to do with unreadable images", choices=BAD_IMAGE_POLICIES)
    check_images: str = _opt(
        "quick",
        "--check-images",
        "before the first step: quick (file signatures; suspects decoded), full (decode all, cached), none",
        choices=IMAGE_CHECKS,
    )
    alpha_background: str = _opt(
        "white",
        "--alpha-background",
        "colour transparent pixels (RGBA, gray+alpha, GIF) are composited over",
        choices=ALPHA_BACKGROUNDS,
    )
    mixup: float = _opt(0.0, "--mixup", "mixup alpha: blend image pairs and their targets (0: off; e.g. 0.2)")
    cutmix: float = _opt(0.0, "--cutmix", "CutMix alpha: paste a box of another image, mix targets by area (0: off)")
    s3_endpoint: str = _opt("", "--s3-endpoint", "URL of an S3-compatible store (default: AWS_ENDPOINT_URL or AWS)")
    s3_concurrency: int = _opt(32, "--s3-concurrency", "S3 requests in flight per worker (and pooled connections)")
    s3_retry_mode: str = _opt("standard", "--s3-retry-mode", "boto3 retry mode", choices=S3_RETRY_MODES)
    s3_max_attempts: int = _opt(5, "--s3-max-attempts", "attempts per S3 request before giving up")

    def table_options(self) -> TableOptions:
        """How a CSV of labels is read, as ``table.TableOptions``."""
        return TableOptions(
            self.path_column,
            self.label_column,
            self.image_root,
            self.min_images_per_label,
            self.split_column,
            multi_label=self.multi_label,
            label_separator=self.label_separator,
        )

    def record_options(self) -> RecordOptions:
        """How other tools' TFRecord files are read, as ``records.RecordOptions``."""
        return RecordOptions(self.record_image_key, self.record_label_key, self.label_offset, self.class_names)

    def s3_options(self) -> S3Options:
        """The S3 settings as ``storage.S3Options``."""
        return S3Options(
            endpoint=self.s3_endpoint,
            concurrency=self.s3_concurrency,
            retry_mode=self.s3_retry_mode,
            max_attempts=self.s3_max_attempts,
        )


@dataclass(frozen=True)
class ModelConfig:
    """The network: a keras.applications backbone and a new classification head.

    Attributes:
        name: a ``keras.applications`` model name (``hvd-train models``), or
            ``FILE.py:FUNCTION`` / ``MODULE:FUNCTION``: a backbone of the user's own (``model.own``).
        weights: ``imagenet``, ``none`` or the path of a backbone weights file.
        freeze_backbone: train only the new head.
        trainable_layers: train only the last N backbone layers (0: all).
        dropout: dropout rate before the new Dense layer.
        head_norm: ``layer``: the pooled features are layer-normalised before
            the new Dense layer, so the head learns at the same rates whatever
            the scale of the backbone's features (a frozen VGG16's are large
            enough to make SGD at 0.01 diverge); ``none``: the plain head;
            ``auto``: ``layer`` with ``--freeze-backbone``, else ``none`` (a
            backbone that trains behind the normalisation gets its gradients
            divided by its features' spread: from scratch, small features and
            huge steps).
        bn_mode: backbone BatchNormalization during training: ``inference``
            (moving statistics frozen, Keras' fine-tuning advice), ``train``,
            or ``auto`` (inference with pretrained weights, train from scratch).
        bn_momentum: moving-average momentum of backbone BatchNormalization
            layers that train; 0 keeps the model's own (0.99/0.999) with
            pretrained weights and uses 0.9 from scratch.
    """

    name: str = _opt("MobileNetV2", "--model", MODEL_HELP)
    weights: str = _opt("imagenet", "--weights", "imagenet, none, or the path of a backbone weights file")
    freeze_backbone: bool = _opt(False, "--freeze-backbone", "train only the new classification head")
    trainable_layers: int = _opt(0, "--trainable-layers", "train only the last N backbone layers (0: all)")
    dropout: float = _opt(0.2, "--dropout", "dropout rate before the new Dense layer")
    head_norm: str = _opt(
        "auto",
        "--head-norm",
        "normalisation of the pooled features before the new Dense layer (auto: layer with --freeze-backbone)",
        choices=HEAD_NORMS,
    )
    bn_mode: str = _opt("auto", "--bn-mode", "backbone BatchNormalization mode", choices=BN_MODES)
    bn_momentum: float = _opt(0.0, "--bn-momentum", "BatchNormalization momentum when it trains (0: auto)")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Attributes:
        optimizer: ``sgd`` (with momentum), ``adam``, or ``adamw`` (Adam
            with ``weight_decay``: ``ADAMW_WEIGHT_DECAY`` unless given, never 0).
        base_lr: learning rate of one worker with ``batch_size`` images; it is
            scaled linearly with the global batch (Goyal et al., 2017).
            ``auto``: rank 0 runs the learning-rate range test (``lr_find``)
            on the run's model and data first, and every rank uses its
            suggestion.
        momentum: SGD momentum.
        warmup_epochs: epochs of linear warmup from ``base_lr`` to the scaled rate.
        lr_schedule: after warmup: ``cosine`` decay to 0, ``step`` drops, or ``constant``.
        lr_drop_factor: factor of each ``step`` drop (MATLAB's LearnRateDropFactor).
        lr_drop_period: epochs between ``step`` drops (MATLAB's LearnRateDropPeriod).
        head_lr_mult: learning-rate multiplier of the new head (MATLAB uses 10).
        weight_decay: decoupled weight decay (Loshchilov and Hutter): each
            update shrinks every kernel by ``lr * weight_decay`` of itself,
            apart from the gradient; BatchNorm, LayerNorm and bias variables
            (all of rank 1) are left alone. With any optimizer: 0 by default,
            ``ADAMW_WEIGHT_DECAY`` with ``adamw``.
        label_smoothing: the training loss's targets are ``1 - s`` on the
            label and ``s / classes`` spread over all classes (Szegedy et
            al.); held-out loss and accuracy are scored against plain labels.
        class_weights: ``auto``: each training image weighs ``images /
            (classes x images of its class)``, so every class weighs the
            same in the loss (for unbalanced folders); ``none``.
        ema: decay of an exponential moving average of the trainable
            weights, updated after every optimizer update (Keras's
            ``use_ema``), and of the BatchNorm moving statistics, after
            every step; the decay warms up as ``min(ema, (1 + n) / (10 +
            n))`` after n updates. Held-out scores and the saved model use
            the averages, checkpoints keep both. 0: off.
        clip_value: each gradient value clipped into ``[-v, v]``; 0: off.
        clip_norm: the gradients scaled down to this global L2 norm when
            theirs is larger; 0: off. Both act on the averaged gradients of
            an update (every rank clips alike), unscaled under a loss scale,
            the sharded head's included; ``--clip-value`` first.
    """

    optimizer: str = _opt("sgd", "--optimizer", "optimizer", choices=OPTIMIZERS)
    base_lr: float | str = _opt(
        0.01,
        "--base-lr",
        "learning rate for one worker, scaled by the number of workers; auto: found by the learning-rate "
        "range test (hvd-train lr-find) on rank 0 before training",
        words=("auto",),
    )
    momentum: float = _opt(0.9, "--momentum", "SGD momentum")
    warmup_epochs: float = _opt(2.0, "--warmup-epochs", "epochs of gradual warmup to the scaled learning rate")
    lr_schedule: str = _opt("cosine", "--lr-schedule", "schedule after warmup", choices=LR_SCHEDULES)
    lr_drop_factor: float = _opt(0.1, "--lr-drop-factor", "factor of each step drop")
    lr_drop_period: int = _opt(10, "--lr-drop-period", "epochs between step drops")
    head_lr_mult: float = _opt(1.0, "--head-lr-mult", "learning-rate multiplier of the new head (SGD)")
    weight_decay: float = _opt(
        0.0,
        "--weight-decay",
        "decoupled weight decay of the kernels (not norms' or biases' variables), any optimizer; "
        f"with --optimizer adamw the default is {ADAMW_WEIGHT_DECAY} (Keras's)",
    )
    label_smoothing: float = _opt(0.0, "--label-smoothing", "label smoothing of the training loss, in [0, 1)")
    class_weights: str = _opt(
        "none", "--class-weights", "auto: weigh each class's images by inverse frequency", choices=CLASS_WEIGHTS
    )
    ema: float = _opt(
        0.0, "--ema", "decay of a moving average of the weights, used to evaluate and save (0: off; e.g. 0.999)"
    )
    clip_value: float = _opt(0.0, "--clip-value", "clip each averaged gradient value into [-V, V] (0: off)")
    clip_norm: float = _opt(
        0.0, "--clip-norm", "scale the averaged gradients down to this global L2 norm (0: off; e.g. 1.0)"
    )


def default_weight_decay(optimizer: str) -> float:
    """The weight decay of ``optimizer`` unless one is given: ``ADAMW_WEIGHT_DECAY`` for adamw, else 0."""
    return ADAMW_WEIGHT_DECAY if optimizer == "adamw" else OptimConfig.weight_decay


@dataclass(frozen=True)
class ComputeConfig:
    """How the model computes.

    Attributes:
        precision: ``fp32``, ``mixed_float16`` (float16 compute, float32
            weights, dynamic loss scaling), ``mixed_bfloat16``, or ``auto``:
            mixed_float16 on GPUs with tensor cores (compute capability 7.0
            or more), fp32 elsewhere.
        xla: ``off``; ``auto``: TensorFlow's XLA auto-clustering; ``jit``:
            the forward and backward pass of the step compiled by XLA, with
            Horovod's allreduce outside the compiled part.
        steps_per_call: batches per call of the compiled step (a loop
            inside one ``tf.function``, as Keras's ``steps_per_execution``):
            the host neither assigns nor reads anything between them. Stops,
            timed checkpoints and elastic commits are agreed every call.
            With ``--grad-accum N`` it is rounded down to whole updates (at
            least N).
    """

    precision: str = _opt("auto", "--precision", "numeric precision of the model", choices=PRECISIONS)
    xla: str = _opt("off", "--xla", "XLA compilation of the train step", choices=XLA_MODES)
    steps_per_call: int = _opt(
        STEPS_PER_CALL, "--steps-per-call", "batches per compiled call (stops and checkpoints are agreed per call)"
    )


@dataclass(frozen=True)
class HorovodConfig:
    """How the workers cooperate.

    Attributes:
        fp16_allreduce: compress gradients to float16 for the allreduce.
        grad_accum: backward passes accumulated per optimizer step.
        threads_per_rank: TensorFlow CPU threads per process (0: usable CPUs / ranks sharing them).
        elastic: run as an elastic Horovod job (``horovodrun --min-np/--max-np
            --host-discovery-script``): workers may leave or join mid-run.
        commit_every: elastic: commit the state in memory every N steps (and
            at every epoch end); a lost worker costs at most N steps.
        elastic_batch: when the number of workers changes: keep each
            worker's batch (the global batch and the learning rate follow the
            workers linearly) or keep the global batch (each worker's batch
            changes, the learning rate does not).
        fusion_threshold_mb: Horovod's tensor fusion buffer in MB (0: Horovod's 128).
        cycle_time_ms: Horovod's cycle time in ms (0: Horovod's 1).
        autotune: Horovod autotunes fusion and cycle time; its log goes to
            ``OUTPUT/horovod_autotune.csv``.
        timeline: Horovod writes a Chrome trace of its operations to
            ``OUTPUT/horovod_timeline.json`` (chrome://tracing, Perfetto).
        hierarchical_allreduce: allreduce within hosts first, then across
            (NCCL and MPI builds, several hosts).
        head_parallel: shard the classification head by class over groups
            of this many workers, data-parallel across groups (0: no; -1:
            one group of every worker). See ``model/sharded_head.py``.
        head_save: a sharded head's saved model: ``whole`` (``model.keras``),
            ``files`` (the network up to the head, and the head's arrays),
            ``auto`` (whole when rank 0 has the memory to hold it).
    """

    fp16_allreduce: bool = _opt(False, "--fp16-allreduce", "compress gradients to float16 for the allreduce")
    grad_accum: int = _opt(1, "--grad-accum", "backward passes per optimizer step (backward_passes_per_step)")
    threads_per_rank: int = _opt(0, "--threads-per-rank", "CPU threads per process (0: usable CPUs / ranks sharing)")
    elastic: bool = _opt(False, "--elastic", "elastic job: workers may leave or join (horovodrun --min-np/--max-np)")
    commit_every: int = _opt(20, "--commit-every", "elastic: commit the state in memory every N steps")
    elastic_batch: str = _opt(
        "keep-worker-batch", "--elastic-batch", "when the number of workers changes", choices=ELASTIC_BATCH
    )
    fusion_threshold_mb: float = _opt(0.0, "--fusion-threshold-mb", "Horovod tensor fusion buffer, MB (0: Horovod's)")
    cycle_time_ms: float = _opt(0.0, "--cycle-time-ms", "Horovod cycle time, ms (0: Horovod's)")
    autotune: bool = _opt(False, "--autotune", "Horovod autotunes fusion and cycle time (log in OUTPUT)")
    timeline: bool = _opt(
        False,
        "--timeline",
        "Horovod timeline, a Chrome trace in OUTPUT (under horovodrun write --horovod-timeline: "
        "horovodrun takes --timeline for its own --timeline-filename/--timeline-mark-cycles)",
        aliases=("--horovod-timeline",),
    )
    hierarchical_allreduce: bool = _opt(False, "--hierarchical-allreduce", "allreduce within hosts, then across")
    head_parallel: int = _opt(
        0, "--head-parallel", "shard the head by class over groups of G workers (0: no; -1: all workers in one group)"
    )
    head_save: str = _opt(
        "auto", "--head-save", "how a sharded head is saved: whole, files, auto (whole if it fits)", choices=HEAD_SAVES
    )

    def environment(self, output: str) -> dict[str, str]:
        """The Horovod variables these options set; read by ``hvd.init()``."""
        env = {}
        if self.fusion_threshold_mb:
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms:
            env["HOROVOD_CYCLE_TIME"] = f"{self.cycle_time_ms:g}"
        if self.autotune:
            env["HOROVOD_AUTOTUNE"] = "1"
            env["HOROVOD_AUTOTUNE_LOG"] = os.path.join(os.path.abspath(output), AUTOTUNE_LOG)
        if self.timeline:
            env["HOROVOD_TIMELINE"] = os.path.join(os.path.abspath(output), TIMELINE)
        if self.hierarchical_allreduce:
            env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        return env


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, in sections."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The configuration as YAML, with no secret in it (an endpoint's user:password is dropped)."""
        values = self.to_dict()
        values["data"]["s3_endpoint"] = redact_url(values["data"]["s3_endpoint"])
        values["run"]["tracker_uri"] = redact_url(values["run"]["tracker_uri"])
        return yaml.safe_dump(values, sort_keys=False)
