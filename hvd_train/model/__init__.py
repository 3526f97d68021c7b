"""The network: which Keras application (``catalogue``), how it is trained a step at a
time (``network``: the model, its optimizer, the step, metrics, BatchNorm statistics)
and how it computes (``compute``: precision, XLA)."""
