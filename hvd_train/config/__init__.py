"""Training configuration: defaults -> YAML file -> command line -> validate().

The configuration is plain frozen dataclasses, one per concern. Each field
carries its command-line flag and help text in its metadata, so the parser,
the YAML keys and the validation messages cannot drift apart. A YAML file
uses the section names as top-level keys::

    data:
      train: /data/flowers
      val_split: 0.1
    model:
      name: ResNet50
    optim:
      base_lr: 0.0125

The resolved configuration is validated once, before any rank reads data,
and written next to the outputs as ``run_config.yaml``.

The package: ``choices`` (the dataclasses and their fields; the run's in
``run_choices``, each field made by ``fields``), ``checks`` (``validate``)
and ``sources`` (flags, YAML, the merge; an option renamed keeps its older
flag and YAML key). Its face names
what callers outside it use, so ``config.from_sources`` and
``config.TrainConfig`` read as one thing.
"""

from hvd_train.config.checks import parse_every
from hvd_train.config.choices import (
    ALPHA_BACKGROUNDS,
    AUGMENTATIONS,
    MODEL_HELP,
    PRECISIONS,
    XLA_MODES,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from hvd_train.config.sources import add_arguments, build, from_sources

__all__ = [
    "ALPHA_BACKGROUNDS",
    "AUGMENTATIONS",
    "MODEL_HELP",
    "PRECISIONS",
    "XLA_MODES",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "add_arguments",
    "build",
    "from_sources",
    "parse_every",
]
