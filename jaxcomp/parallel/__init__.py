"""Executing a pipeline: one device (simulate) or stages across devices (sharded: GPipe / 1F1B
schedules, data parallelism), the compressed `ppermute` the sharded executor sends with, and AQ-SGD
tables in host memory."""
