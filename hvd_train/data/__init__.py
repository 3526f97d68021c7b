"""Data sources and the tf.data input pipeline."""
