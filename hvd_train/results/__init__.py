"""What a run leaves and what is made from it: evaluation (exact, across ranks),
inference (a finished run loaded and checked), export (SavedModel, TFLite, ONNX),
plots and the report page."""
