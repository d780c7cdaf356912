"""Running experiments: the train loop, checkpoints, results, locks and multi-host start-up."""
