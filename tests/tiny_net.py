"""The tests' backbone: three convolutions, a model of the user's own (``--model tiny_net.py:backbone``).

Jobs that test launching, stopping, resuming and reading data need a network
that learns, not a Keras application: this one builds and traces in a
fraction of MobileNet's time (a one-epoch run of one process: about 10
CPU-seconds against 17), in every process of the suite.
"""

import keras  # the run's Keras: tf_keras under HVD_TRAIN_KERAS=2 (hvd_train makes `keras` it), Keras 3 under 3


def backbone(input_shape):
    images = keras.Input(input_shape)
    x = images
    for n, filters in enumerate((8, 16, 32)):
        x = keras.layers.Conv2D(filters, 3, strides=2, padding="same", use_bias=False, name=f"conv{n}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{n}")(x)
        x = keras.layers.ReLU(name=f"relu{n}")(x)
    return keras.Model(images, x, name="tiny")
