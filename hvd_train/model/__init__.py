"""The network: which backbone, a Keras application or one of the user's own (``catalogue``,
``own``), how it is trained a step at a time (``network``: the model, its optimizer, the
step, metrics, BatchNorm statistics) and how it computes (``compute``: precision, XLA)."""
