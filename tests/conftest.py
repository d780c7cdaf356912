"""Test setup: 8 fake CPU devices so 2-8 stage pipelines run without an accelerator."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
