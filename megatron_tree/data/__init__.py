"""Data: synthetic presets, file readers, and (later) the training data pipeline."""
