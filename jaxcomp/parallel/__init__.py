"""Executing a pipeline: one device (simulate) or stages across devices (sharded: typed schedules
(`schedules`), each a timetable of ops per device and tick (`timetable`) compiled once into a plan (`plan`)
that a stage runner reads (`stage_runner`, `overlapped_sends`); data parallelism), the compressed `ppermute`
the sharded executor sends with, AQ-SGD tables in host memory, and the one factory that builds an executor
from its typed config (`executors`)."""
