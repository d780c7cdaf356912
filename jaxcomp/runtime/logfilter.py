"""Drops the Orbax log lines that every correct run repeats, or that report what jaxcomp handles, and nothing else.

* "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs found ...":
  once per item of every save of a single-process run (nothing to merge).
* 'Item "model" was found in the checkpoint, but could not be restored ...': once per item
  whenever the manager reads a step's metadata without handlers; restores pass explicit
  arguments, and a restore that fails raises.
* "Failed to json parse Metadata file" / "Failed to read Metadata file" (ERROR): a step's
  `_CHECKPOINT_METADATA` (timestamps) is damaged; Orbax goes on without it, and
  `checkpoint.Checkpointer` checks every item it restores against its checksums, reporting a
  corrupt checkpoint itself (CorruptCheckpointError, or a warning when it falls back to an older one).

Orbax logs through absl, i.e. the Python logger "absl"; other records above WARNING always pass.
"""
import logging

ORBAX_NOISE = ("Skipping merge of OCDBT checkpoints", "was found in the checkpoint, but could not be restored")
ORBAX_HANDLED = ("Failed to json parse Metadata file", "Failed to read Metadata file")


class OrbaxNoiseFilter(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if any(text in message for text in ORBAX_HANDLED):
      return False
    return record.levelno > logging.WARNING or not any(text in message for text in ORBAX_NOISE)


def silence_orbax_noise():
  """Installs OrbaxNoiseFilter on the "absl" logger (once)."""
  logger = logging.getLogger("absl")
  if not any(isinstance(f, OrbaxNoiseFilter) for f in logger.filters):
    logger.addFilter(OrbaxNoiseFilter())
