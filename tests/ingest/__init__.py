"""OTLP decoding and the receivers: exporters, captured fixtures, bad input, fuzzing, slow clients."""
