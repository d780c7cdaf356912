"""One acceptance command for a lent accelerator: it measures what the dry runs only estimate.

    python -m benchmarks.device_check [--out runs/device_check] [--budget-s 450] [--tiny]
    python -m benchmarks.device_check --sections provenance,codecs --budget-s 300   # the codecs alone, < 5 min

Sections, in this order (`--sections` picks some), each run in a child process (a crash or a device out of
memory costs that section only; its error is recorded and the others go on), each skipped with its reason once
the time budget would not hold it; `device_check.json` and `device_check.md` are rewritten after each child:
  provenance  the device (kind, platform, driver, memory) and the software (jax, jaxlib, CUDA/TPU plugins,
              python), the commit and the date: every figure below was measured there
  codecs      encode + decode of each codec family (CODECS, TopK with each selection) on a GPT-2 small and an XL
              boundary activation ([8, 1024, 768] and [8, 1024, 1600], bfloat16 and float32): GB/s of the dense
              tensor, and the bytes the pair must move (2 x (dense + payload)) over its time as a fraction of the
              copy bandwidth measured on the same tensor (x + 1); goal >= 0.5 for quantizers, >= 0.25 for TopK
              (pass/fail); beside it the same ops compiled for this device (`analysis.codec_cost`): their logical
              bytes over the measured time as a fraction of the chip's published HBM bandwidth (the 80% question),
              the compiled program's passes over memory and its roofline time against the measured one
  steps:small GPT-2 small, paper recipe (batch 8 x 1024, 4 stages, AdamW, clipping), simulate on the one device:
              the train step of each of PRESETS (fp32 first), one child each: the measured step time (its ratio
              to fp32 is compression's cost; goal <= 1.05) and peak device memory (`memory_stats`), beside the
              dry run's figures of the very program that ran (`dryrun.compile_step`: memory analysis, FLOPs, HBM
              traffic, and the roofline estimate from the chip's published peaks where `targets.for_device_kind`
              knows the chip). A step whose predicted peak exceeds the free device memory is skipped, said why.
  compile-only  `--compile-for TARGET`'s dry run (`dryrun.compile_for`, compile-only devices in a CPU-only child,
              train step) of GPT-2 small fp32 and top10-reuse for this device's target (or --compile-target),
              beside what steps:small measured; it runs in the background from the start
  sharded     the sharded executor on a 1-stage mesh of this device (a 1-stage GPT-2: no boundary) against
              simulate on the same state and batch: the losses of 3 steps and the step times
  tests       `pytest -x` (-q from pyproject) on the codec, scheme and boundary tests with this device as JAX's backend
              (JAX_PLATFORMS, which tests/conftest.py leaves as it finds it)
  steps:medium, steps:xl  as steps:small for GPT-2 medium and XL (fp32, top10-reuse, aqsgd-fw2-bw4)
`--tiny`: every section at toy sizes (GPT-2 tiny, 32-token blocks, [2, 16, 64] activations, one test file), in
seconds on a CPU (tests/test_benchmarks.py runs it and checks the JSON). Nothing here is a figure unless it was
measured or compiled in this run: fields say which (`measured`, `dry_run`: compiled not run, `estimate`).

Modules: `settings` (what is measured, goals, budgets), `children` (each section's child process), `command`
(the parent: budget, children, results), `report` (device_check.md).
"""
