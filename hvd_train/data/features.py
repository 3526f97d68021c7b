"""What a TFRecord of a shard set holds: the feature keys of its image and label, and the label's kind.

``hvd-train pack`` writes ``image/encoded`` and a class index under
``image/class/label``; other tools' files (``data.records``) name them
otherwise, count from 1, or label with strings. ``RecordFeatures`` says
which, and its ``parser`` turns one serialized ``tf.train.Example`` into
``(encoded image, own label index)`` inside tf.data; ``RecordOptions`` are
the options that say it (this module imports TensorFlow only to parse).
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/class/label"


@dataclass(frozen=True)
class RecordFeatures:
    """How a record gives its image and label.

    Attributes:
        image_key: the feature holding the encoded image.
        label_key: the feature holding the label.
        offset: subtracted from an integer label (1 for sets that count from 1).
        vocabulary: for string labels, the set's own classes in label order
            (a string's index is its label); empty for integer labels.
        kind: ``pack`` (written by ``hvd-train pack``), ``records`` (other
            tools' files, read through their index: ``data.records``) or
            ``tfds`` (a prepared TFDS folder's split: ``data.tfds``).
    """

    image_key: str = IMAGE_KEY
    label_key: str = LABEL_KEY
    offset: int = 0
    vocabulary: tuple[str, ...] = ()
    kind: str = "pack"

    def parser(self):
        """``f(serialized record) -> (encoded image, int32 label)``, for ``Dataset.map``."""
        from hvd_train.compat import tf

        kind = tf.string if self.vocabulary else tf.int64
        spec = {
            self.image_key: tf.io.FixedLenFeature([], tf.string),
            self.label_key: tf.io.FixedLenFeature([], kind),
        }
        table = None
        if self.vocabulary:  # made here, eagerly: a map function may capture it, not create it
            keys = tf.constant(list(self.vocabulary))
            values = tf.range(len(self.vocabulary), dtype=tf.int64)
            table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(keys, values), -1)

        def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            parsed = tf.io.parse_single_example(record, spec)
            label = parsed[self.label_key]
            label = table.lookup(label) if table is not None else label - self.offset
            return parsed[self.image_key], tf.cast(label, tf.int32)

        return parse


@dataclass(frozen=True)
class RecordOptions:
    """How other tools' TFRecords are read (``--record-image-key`` and the rest; see ``data.records``)."""

    image_key: str = IMAGE_KEY
    label_key: str = LABEL_KEY
    label_offset: int = 0
    class_names: str = ""
    split: str = ""  # a TFDS folder's split: "" for train (training data) or validation, else test (held out)
    class_list: tuple[str, ...] = ()  # the class names themselves, instead of a file of them (not a flag)

    FLAGS = (
        ("--record-image-key", "image_key"),
        ("--record-label-key", "label_key"),
        ("--label-offset", "label_offset"),
        ("--class-names", "class_names"),
    )

    def given(self) -> list[tuple[str, object]]:
        """``(flag, value)`` of each option set off its default."""
        default = RecordOptions()
        return [(flag, getattr(self, f)) for flag, f in self.FLAGS if getattr(self, f) != getattr(default, f)]
