"""hvd_train: fine-tune Keras applications image classifiers with Horovod."""

__version__ = "0.1.0"
