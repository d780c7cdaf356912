"""Executing a pipeline: one device (simulate) or stages across devices (sharded: GPipe / 1F1B
schedules, data parallelism), and what its compiled program sends, computes and costs."""
