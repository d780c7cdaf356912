"""Reading and modelling programs, executing none: bytes and FLOPs of compiled programs, the network
simulator, accelerator targets and dry runs (an executor's steps compiled for a target, through the
`pipeline.Executor` contract alone)."""
