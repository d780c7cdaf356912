"""Running experiments: the train loop, checkpoints, results, locks, multi-host start-up, and dry
runs compiled for an accelerator target."""
