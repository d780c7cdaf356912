"""Executing a pipeline: one device (simulate) or stages across devices (sharded: GPipe / 1F1B
schedules, each a table of ops per device and tick (`schedules`), data parallelism), the compressed
`ppermute` the sharded executor sends with, and AQ-SGD tables in host memory."""
