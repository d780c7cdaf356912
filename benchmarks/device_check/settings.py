"""What device_check measures, its goals and its time budget."""
import pathlib

BUDGET_S = {False: 450, True: 1800}  # the whole command's: under the 8 minutes a lent device is planned for


PRESETS = ("fp32", "top10-reuse", "aqsgd-fw2-bw4", "direct-fw4-bw8", "tile64-fw3-bw4")


LARGE_PRESETS = TINY_PRESETS = ("fp32", "top10-reuse", "aqsgd-fw2-bw4")


COMPILE_ONLY_PRESETS = ("fp32", "top10-reuse")


QUANTIZER_GOAL, TOPK_GOAL, OVERHEAD_GOAL = 0.5, 0.25, 1.05


CODECS = (  # (family, spec, goal: the pair's bytes moved / time as a fraction of the copy bandwidth)
    ("minmax", "quant:2", QUANTIZER_GOAL), ("minmax", "quant:4", QUANTIZER_GOAL), ("minmax", "quant:8", QUANTIZER_GOAL),
    ("max-abs", "maxabs:2", QUANTIZER_GOAL), ("max-abs", "maxabs:4", QUANTIZER_GOAL),
    ("max-abs", "maxabs:8", QUANTIZER_GOAL),
    ("grouped", "maxabs:3:group=64", QUANTIZER_GOAL), ("grouped", "maxabs:4:group=64:stoch", QUANTIZER_GOAL),
    ("TopK", "topk:0.1", TOPK_GOAL), ("TopK", "topk:0.1:q8", TOPK_GOAL), ("TopK", "topk:0.1:q8:threshold", TOPK_GOAL),
    ("TopK", "topk:0.1:q8:sort", TOPK_GOAL), ("TopK", "topk:0.1:q8:approx", TOPK_GOAL), ("TopK", "reuse", TOPK_GOAL),
    ("fp8", "fp8:scaled", QUANTIZER_GOAL), ("Hadamard", "hadamard+maxabs:4:group=64", QUANTIZER_GOAL))


SHAPES = {False: ((8, 1024, 768), (8, 1024, 1600)), True: ((2, 16, 64),)}


DTYPES = ("bfloat16", "float32")


TEST_FILES = {False: ("tests/test_codecs.py", "tests/test_schemes.py", "tests/test_boundary.py"),
              True: ("tests/test_schemes.py",)}


SECTIONS = ("provenance", "compile-only", "codecs", "steps:small", "sharded", "tests", "steps:medium", "steps:xl")


# seconds a section needs at least to be worth starting (full size; --tiny: none)
MIN_SECONDS = {"provenance": 5, "codecs": 30, "steps:small": 45, "sharded": 40, "tests": 30, "steps:medium": 60,
               "steps:xl": 90}


CALLS = 10  # codec and copy calls timed back to back (`common.pipelined_seconds`)


GPU_MEMORY_FRACTION = "0.95"  # of device memory the step children may use (JAX's default is 0.75)


ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout

