"""Drops the two Orbax warnings that every correct run repeats, and nothing else.

* "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs found ...":
  once per item of every save of a single-process run (nothing to merge).
* 'Item "model" was found in the checkpoint, but could not be restored ...': once per item
  whenever the manager reads a step's metadata without handlers; restores pass explicit
  arguments, and a restore that fails raises.

Orbax logs through absl, i.e. the Python logger "absl"; records above WARNING always pass.
"""
import logging

ORBAX_NOISE = ("Skipping merge of OCDBT checkpoints", "was found in the checkpoint, but could not be restored")


class OrbaxNoiseFilter(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno > logging.WARNING or not any(text in record.getMessage() for text in ORBAX_NOISE)


def silence_orbax_noise():
  """Installs OrbaxNoiseFilter on the "absl" logger (once)."""
  logger = logging.getLogger("absl")
  if not any(isinstance(f, OrbaxNoiseFilter) for f in logger.filters):
    logger.addFilter(OrbaxNoiseFilter())
