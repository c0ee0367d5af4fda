"""Data: synthetic presets, JSONL/Parquet readers and the training data pipeline.

``TreeDataPipeline`` packs each step's window of samples into prefix-shared microbatches, shards
them over DP ranks balanced by predicted cost (equal microbatch counts per rank), packs ahead in a
background thread, and saves/restores its position exactly.
"""
from .io import DataError, ReadReport, read_jsonl, write_jsonl
from .pipeline import PipelineTiming, TreeDataPipeline, TreeStep, read_samples
from .synthetic import PRESETS, make_preset

__all__ = ["DataError", "ReadReport", "read_jsonl", "write_jsonl", "read_samples", "TreeDataPipeline", "TreeStep",
           "PipelineTiming", "PRESETS", "make_preset"]
