"""Test setup: 8 fake CPU devices so 2-8 stage pipelines run without an accelerator."""
import os

# LLVM at -O0: the tests are compile-bound (tiny shapes), and XLA's HLO passes and float
# semantics (no fast-math at any level) are unchanged; tests/test_gpipe.py 214 s -> 174 s.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
