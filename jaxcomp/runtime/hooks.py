"""What the training driver calls at its events (`train.fit(..., hooks=)`)."""
from jaxcomp.compress.boundary import Mode


class Hook:
  """What `fit` calls at its events, as Levanter's trainer hooks: subclass and override the events you need (each
  is a no-op here; none may change what the run computes). `run` is the driver's `train.Run` at that moment.

    before_step(run, mode, step, args)   a train step of `mode` (a `Mode`) is about to run as
                                         `step(run.state, *args)`
    before_evaluate(run, compressed)   an evaluation with compression on (True) or off (False) begins
    before_checkpoint(run) / after_checkpoint(run)   around each checkpoint's save
    after_fit(run)   training is over (`run.state` is the final state)
  """

  def before_step(self, run, mode: Mode, step, args: tuple):
    pass

  def before_evaluate(self, run, compressed: bool):
    pass

  def before_checkpoint(self, run):
    pass

  def after_checkpoint(self, run):
    pass

  def after_fit(self, run):
    pass
