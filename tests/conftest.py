"""Test setup: 8 fake CPU devices so 2-8 stage pipelines run without an accelerator, and XLA:CPU
compiling without LLVM's expensive passes: the suite's time is mostly compiling small programs
(docs/dev/tests.md). Subprocesses that compare their numbers with this process take the same flags
(`benchmarks.common.xla_flags_with_devices`). JAX_PLATFORMS and XLA_FLAGS already set win:
`JAX_PLATFORMS=cuda python -m pytest tests/test_codecs.py` runs on a GPU (`benchmarks.device_check` runs the codec, scheme and boundary tests so).

Many tests compile the same programs (the tiny GPT-2's train and eval steps, each seed of a sweep, simulate's
reference beside each executor): one run of the suite shares JAX's persistent compilation cache among its processes
(the xdist workers and the subprocesses they start), in a temporary folder this process makes and removes at the
end. Every program is still compiled by XLA once per run; a JAX_COMPILATION_CACHE_DIR already set wins (and is
kept)."""
import os
import shutil
import tempfile

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run (xdist's workers inherit it)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE = tempfile.mkdtemp(prefix="jaxcomp-tests-xla-cache-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program: most of the suite's are small
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
else:
  OWN_CACHE = None

from jaxcomp.analysis import targets  # noqa: E402  (the flags above first)

# the tests compile for TPU targets on this CPU host: libtpu is told it runs on no TPU VM (no metadata server)
targets.prepare_host(targets.target("v5e-8"))


# The files that take longest, longest first (measured: docs/dev/tests.md). `--dist loadfile` hands whole files to the
# workers in collection order (xdist would otherwise put the files with most tests first): with the long ones
# first, no worker is left running a long file alone at the end while the other idles.
LONGEST_FIRST = ("test_codecs.py", "test_real_link.py", "test_sharded.py", "test_dryrun.py", "test_benchmarks.py",
                 "test_train.py", "test_maxtext.py", "test_notebooks.py", "test_permute.py", "test_tied.py",
                 "test_experiments.py", "test_scale_axes.py", "test_device_check.py", "test_documented_commands.py")


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: keep the order below
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def pytest_unconfigure(config):
  if OWN_CACHE and not hasattr(config, "workerinput"):  # the process that made the cache folder removes it
    shutil.rmtree(OWN_CACHE, ignore_errors=True)
