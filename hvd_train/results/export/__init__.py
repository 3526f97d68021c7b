"""Exports of a trained run that carry its preprocessing: SavedModel, TFLite and ONNX.

A served classifier fed raw pixels gives confident nonsense: the network
expects its backbone's scaling, the training image size and the centre crop
of evaluation. So every export starts where a client starts:

* the SavedModel takes encoded image bytes (``serving_default``: decoded,
  transparent pixels composited as in training, centre-cropped, resized,
  scaled) or a uint8 batch of any size (``serving_uint8``), and answers with
  the probabilities, the top-k class indices and the class names;
* TFLite and ONNX cannot decode, so they take a uint8 batch already cut to
  ``image_size`` x ``image_size`` (``image``) and scale it inside; the
  folder's README says how to cut it, and ``labels.json`` names the classes.

The converters are TensorFlow's own (SavedModel, TFLite) and tf2onnx;
``check`` runs each file in its own runtime (TensorFlow, LiteRT,
ONNX Runtime) on labelled images and compares it with ``hvd-train predict``.

The modules: ``serving`` (the SavedModel's signatures, the fixed-size Keras
model of the other formats, the pixels they are given), ``formats`` (the
writers, and each file run in its runtime), ``parity`` (the check against
predict) and ``folder`` (the export folder: written beside its place,
described, and swapped in whole).
"""
