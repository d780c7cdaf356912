"""The documented commands and how each is checked (`REGISTRY`, read by tests/test_documented_commands.py): the pages
that show them, the toy-size flags and placeholders their cases use, and `documented`, which finds them in the pages."""
import pathlib
import re
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL_PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
PAGES = ALL_PAGES
COMMAND = re.compile(r"python -m ((?:benchmarks|experiments)\.\w+)(.*)")
GPT2_TINY = ("--steps", "2", "--epochs", "1", "--batch-size", "4", "--block-size", "32", "--train-examples", "16",
             "--eval-examples", "8", "--no-progress")
RESNET_TINY = ("--steps", "2", "--epochs", "1", "--width", "8", "--batch-size", "10", "--train-examples", "40",
               "--eval-examples", "20", "--no-progress")
FRONTIER_TINY = ("--steps", "1", "--train-examples", "16", "--eval-examples", "8", "--batch-size", "8",
                 "--methods", "fp32")
BOUNDARY_TINY = ("--steps", "2", "--epochs", "1", "--every", "1", "--train-examples", "16", "--eval-examples", "8",
                 "--batch-size", "4", "--block-size", "32", "--no-progress")
TTT_METHODS = ("fp32,bf16,aqsgd-fw2-bw4,top10-q8-reuse,proj16-fw3-bw4,direct-fw4-bw8,tile64-fw3-bw4,had-fw3-bw4,"
               "direct-fw2-bw4,fp8,sfp8,quant-fw4-bw8,top10-bf16-reuse,ef-top10-reuse,sfp8-channel,tile16-fw3-bw4,"
               "had-fw2-bw4,top10-reuse,chan-tile64-fw3-bw4,had-fw2-bw3,had-adapt23-bw4,adapt34-bw4,ef21-top10-reuse,"
               "efmixed-top10,rand10,subspace16-fw3-bw4,proj16-fw4-bw4,proj24-fw2-bw3,proj8-fw4-bw4,proj32-fw2-bw2,"
               "proj16-fp32")  # the methods of docs/results/time_to_target.md's table
# placeholders of the docs' commands (whole arguments) and what stands in for them here
PLACEHOLDERS = {"runs/E/results": "runs/gpt2_wikitext/results", "resnet|gpt2": "gpt2", "S": "2",
                "FWD": "maxabs:2:stoch", "BWD": "maxabs:4:stoch", "$seed": "0", "NAME": "fp32",
                "/shared/runs": "shared/runs"}


class Case(NamedTuple):
  """How one documented command is checked: `argv` (its documented arguments, placeholders filled in, then toy-size
  flags) run here after the documented commands `before` (a baseline, results to report on), in one fresh folder,
  printing `expect`; or `covered`: the existing test (file::name) that runs it with its documented flags. `slow`:
  only in `pytest -m slow`; then `reached_by` may name a default-suite test that runs the module's default path
  with other toy flags (a heavy part skipped)."""
  argv: tuple[str, ...] | None = None
  before: tuple[str, ...] = ()
  expect: str = ""
  covered: str = ""
  slow: bool = False
  why: str = ""  # why it is covered elsewhere, or slow
  reached_by: str = ""


def documented(pages=PAGES, command=COMMAND) -> dict[str, str]:
  """{command: the page that shows it first} for every `python -m benchmarks.X|experiments.X` (`command`) in a
  fenced or indented code block or an inline code span of `pages`."""
  found = {}
  for page in pages:
    text = (ROOT / page).read_text()
    fenced = re.findall(r"```.*?```", text, re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    indented = re.findall(r"(?m)^(?: {4}.*\n?)+", prose)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(r"(?m)^(?: {4}.*\n?)+", "", prose))]
    for block in fenced + indented + spans:
      for line in re.sub(r"\\\n", "", block).splitlines():  # a continuation joins as the shell joins it
        m = command.search(line)
        if m:
          args = re.sub(r"(^|\s)#.*", "", m.group(2)).split()
          found.setdefault(" ".join(["python -m", m.group(1), *args]), page)
  return found


def module_of(command: str) -> str:
  return command.split()[2]


REGISTRY = {
    # --- README.md
    "python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4 --train-examples 2000": Case(
        covered="tests/test_experiments.py::test_gpt2_presets_smoke", why="--preset aqsgd-fw2-bw4, toy sizes"),
    "python -m experiments.resnet_cifar10 --list-presets": Case(
        ("--list-presets",), expect="ef21-top10-base20"),
    "python -m experiments.resnet_cifar10 --preset top10": Case(
        ("--preset", "top10", *RESNET_TINY), slow=True, why="runs by default as the report's first command"),
    "python -m experiments.resnet_cifar10 --preset baseline --epochs 20": Case(
        ("--preset", "baseline", "--epochs", "20", *RESNET_TINY), slow=True, why="a second ResNet run"),
    "python -m experiments.resnet_cifar10 --preset ef21-top10-base20 --init-from runs/resnet_cifar10/baseline": Case(
        ("--preset", "ef21-top10-base20", "--init-from", "runs/resnet_cifar10/baseline", "--init-epoch", "1",
         *RESNET_TINY),
        before=("python -m experiments.resnet_cifar10 --preset baseline --epochs 20",), slow=True,
        why="two ResNet runs: the baseline (its toy run ends at epoch 1, hence --init-epoch 1), then the warm start "
            "from its folder"),
    "python -m experiments.finetune": Case(
        covered="tests/test_finetune.py::test_a_toy_study_pretrains_once_fine_tunes_reports_and_a_rerun_trains_nothing",
        slow=True, why="hours on 2 cores; the toy study runs its every part (pretraining, fine-tuning, report) and "
                       "its rerun", reached_by="tests/test_finetune.py::test_a_one_method_toy_study_runs_and_reports"),
    "python -m experiments.gpt2_wikitext --recipe paper --preset top10-reuse --pretrained gpt2 --data wikitext2-raw":
        Case(covered="tests/test_finetune.py::test_the_papers_text_comes_from_the_hub_as_its_rows_joined",
             why="downloads WikiText-2 raw and GPT-2 (no test reaches the network); the offline parts are tested on "
                 "stand-ins: the hub's rows here, the hub cache of weights and tokenizer in tests/test_gpt2.py"),
    "python -m experiments.gpt2_wikitext --recipe paper --preset aqsgd-fw3-bw6 --pretrained gpt2-xl --data "
    "wikitext2-raw --stages 8 --executor sharded --schedule 1f1b --microbatches 8": Case(
        covered="tests/test_finetune.py::test_the_papers_text_comes_from_the_hub_as_its_rows_joined",
        why="GPT2-1.5B on 8 GPUs with the downloads; its dry run (--compile-for h100-8) is in docs/guide/papers.md, "
            "the sharded 1F1B executor at toy size in tests/test_sharded.py"),
    "python -m experiments.gpt2_wikitext --preset top10-reuse --executor sharded --stages 4 --data-parallel 2": Case(
        ("--preset", "top10-reuse", "--executor", "sharded", "--stages", "4", "--data-parallel", "2", *GPT2_TINY),
        slow=True, why="the sharded executor on 8 devices; by default 2 x 2 in test_gpipe_executor_from_the_cli"),
    "python -m experiments.gpt2_wikitext --recipe paper --preset top10-reuse --compile-for v5e-1": Case(
        ("--recipe", "paper", "--preset", "top10-reuse", "--compile-for", "v5e-1", "--model", "tiny",
         "--block-size", "32", "--batch-size", "4", "--train-examples", "64"), expect="--compile-for v5e-1",
        slow=True, why="compiles for a TPU target; by default tests/test_dryrun.py compiles the tiny recipe"),
    "python -m experiments.report runs/resnet_cifar10/results --paper resnet": Case(
        ("runs/resnet_cifar10/results", "--paper", "resnet"),
        before=("python -m experiments.resnet_cifar10 --preset top10",), expect="| top10 |", slow=True,
        why="a ResNet run to report on (100 s); by default the report's --paper table runs on results files",
        reached_by="tests/test_report.py::test_report_shows_the_runs_average_bytes_per_step"),
    "python -m experiments.report runs/E/results --paper resnet|gpt2": Case(
        ("runs/gpt2_wikitext/results", "--paper", "gpt2"), before=("python -m experiments.gpt2_wikitext",),
        expect="wrote runs/gpt2_wikitext/results/report.md", slow=True, why="a GPT-2 run to report on"),
    "python -m experiments.frontier --seeds 3": Case(
        ("--seeds", "3", *FRONTIER_TINY), expect="| fp32 |", slow=True,
        why="three seeds of every tiny run (45 s); by default two seeds run through the same main",
        reached_by="tests/test_frontier.py::test_seeds_run_separately_and_the_table_compares_means"),
    # --- docs/guide/benchmarks.md
    "python -m benchmarks.X": Case(covered="tests/test_documented_commands.py::test_each_module_reaches_its_default_"
                                           "path_by_default", why="the page's pattern for the commands below"),
    "python -m benchmarks.wire_bytes": Case(
        ("--shape", "4,64"), expect="| `efmixed+topk:0.1` |", slow=True,
        why="compiles the 4-stage GPipe program of every method (minutes); by default its codec table runs",
        reached_by="tests/test_benchmarks.py::test_benchmark_prints_its_table"),
    "python -m benchmarks.codec_throughput": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="toy --shape and --repeats"),
    "python -m benchmarks.device_check": Case(
        covered="tests/test_device_check.py::test_a_failing_step_is_recorded_and_the_next_one_runs",
        why="a GPU's acceptance run; on the CPU --tiny (its quick sections by default, every section in the slow "
            "test_a_tiny_run_fills_every_section)"),
    "python -m benchmarks.topk_selection": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="toy --shape and --repeats"),
    "python -m benchmarks.step_overhead": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="toy sizes, one preset"),
    "python -m benchmarks.throughput_vs_bandwidth": Case(
        covered="tests/test_benchmarks.py::test_throughput_table_rows_and_label", why="toy --seq and --batch"),
    "python -m benchmarks.real_link": Case(
        covered="tests/test_real_link.py::test_a_train_step_moves_at_most_10_percent_more_than_it_counts",
        why="as root, the documented flags at toy sizes (skipped with the reason without root)"),
    "python -m benchmarks.aqsgd_buffers": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="toy --examples, --batch, --seq"),
    "python -m benchmarks.quantizer_error": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="toy shapes"),
    "python -m benchmarks.accelerator_fit": Case(
        covered="tests/test_benchmarks.py::test_fit_table_renders_the_cached_cells_and_marks_the_rest",
        why="its default columns compile GPT-2 xl for many targets: toy models and cached cells"),
    "python -m benchmarks.aqsgd_drift": Case(GPT2_TINY, expect="| epoch |"),
    "python -m benchmarks.ppermute": Case(
        covered="tests/test_benchmarks.py::test_benchmark_prints_its_table", why="a toy --shape on 2 devices"),
    "python -m benchmarks.pipeline_scale": Case(
        ("--stages", "2", "--microbatches", "2", "--executors", "gpipe", "--repeats", "1", "--seq", "8"),
        expect="| 2 | 2 | gpipe |"),
    "python -m benchmarks.init_memory": Case(("--stages", "2", "--models", "small", "--seq", "8"),
                                             expect="small"),
    "python -m benchmarks.codec_compiled": Case(
        covered="tests/test_codec_compiled.py::test_a_target_fills_every_cell_resumes_and_summarises",
        why="compiles every codec for four GPU and TPU targets (hours); the test runs its parts (measure_target, "
            "then the summary) on a toy shape for v5e-1"),
    "python -m benchmarks.protocol_records --compile-for h100-8": Case(
        covered="tests/test_protocol_records.py::test_a_method_ties_a_record_at_its_T_over_its_faster_step_times_the_"
                "dense_records_steps",
        why="compiling for h100-8 needs the CUDA PJRT plugin (not in the test extra); the test runs the records' "
            "table on the tiny protocol model with a stand-in clock"),
    # --- docs/guide/experiments.md
    "python -m experiments.resnet_cifar10 --recipe tiny --preset fw4-bw8 --train-examples 2500": Case(
        ("--recipe", "tiny", "--preset", "fw4-bw8", "--train-examples", "2500", *RESNET_TINY), slow=True,
        why="another preset of the default path"),
    "python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4": Case(
        covered="tests/test_experiments.py::test_gpt2_presets_smoke", why="--preset aqsgd-fw2-bw4, toy sizes"),
    "python -m experiments.resnet_cifar10": Case(RESNET_TINY, slow=True, why="the README's ResNet rows run by default"),
    "python -m experiments.gpt2_wikitext": Case(GPT2_TINY, slow=True, why="the README's first run runs by default"),
    "python -m experiments.report": Case(
        covered="tests/test_documented_commands.py::test_documented_command_runs",
        why="the module's name in prose; run as the README shows it (runs/resnet_cifar10/results --paper resnet)"),
    "python -m experiments.boundary_error --fwd hadamard+maxabs:2:group=64:stoch "
    "--bwd hadamard+maxabs:4:group=64:stoch --every 16 --steps 192 --epochs 6 --train-examples 256 "
    "--eval-examples 128 --batch-size 8": Case(
        ("--fwd", "hadamard+maxabs:2:group=64:stoch", "--bwd", "hadamard+maxabs:4:group=64:stoch", "--every", "16",
         "--steps", "192", "--epochs", "6", "--train-examples", "256", "--eval-examples", "128", "--batch-size", "8",
         "--steps", "2", "--epochs", "1", "--every", "1", "--train-examples", "16", "--eval-examples", "8",
         "--batch-size", "4", "--block-size", "32", "--no-progress"), expect="[boundary_error] fwd hadamard",
        slow=True, why="a GPT-2 run with its probes; by default with other flags",
        reached_by="tests/test_experiments.py::test_boundary_error_measures_each_boundary_and_refuses_aqsgd"),
    # --- docs/guide/accelerators.md
    "python -m experiments.gpt2_wikitext --recipe paper --model xl --preset aqsgd-fw2-bw4 --compile-for v5e-8 "
    "--executor sharded --stages 8": Case(
        ("--recipe", "paper", "--model", "xl", "--preset", "aqsgd-fw2-bw4", "--compile-for", "v5e-8", "--executor",
         "sharded", "--stages", "8", "--model", "small", "--block-size", "32", "--batch-size", "4",
         "--train-examples", "64", "--train-only"), expect="--compile-for v5e-8: run aqsgd-fw2-bw4", slow=True,
        why="compiles 8 GPipe stages for a TPU slice (GPT-2 small: the tiny model has 4 blocks); by default "
            "tests/test_dryrun.py compiles the sharded executor for v5e slices"),
    "python -m benchmarks.accelerator_fit --models small --methods baseline --columns v5e-1": Case(
        covered="tests/test_benchmarks.py::test_fit_table_stops_a_compile_past_the_host_memory_limit_and_goes_on",
        why="this cell, with a --cache of its own and a host-memory limit that stops its compile at once (the "
            "compile itself takes minutes)"),
    "python -m benchmarks.accelerator_fit --table-only": Case(
        covered="tests/test_benchmarks.py::test_fit_table_renders_the_cached_cells_and_marks_the_rest",
        why="--table-only from a cache of its own"),
    "python -m benchmarks.device_check --commit COMMIT": Case(
        ("--commit", "COMMIT", "--tiny", "--sections", "provenance"), expect="commit COMMIT"),
    "python -m benchmarks.device_check --tiny": Case(
        covered="tests/test_device_check.py::test_a_tiny_run_fills_every_section", slow=True,
        why="every section at toy sizes (minutes); by default the quick sections run --tiny",
        reached_by="tests/test_device_check.py::test_a_failing_step_is_recorded_and_the_next_one_runs"),
    # --- docs/results/accelerators.md
    "python -m benchmarks.accelerator_fit --cache runs/accelerator_fit.json": Case(
        covered="tests/test_benchmarks.py::test_fit_table_stops_a_compile_past_the_host_memory_limit_and_goes_on",
        why="the default models, methods and columns compile for hours; the test runs one cell through --cache "
            "(stopped by its host-memory limit) and reads its record back"),
    "python -m benchmarks.accelerator_fit --columns h100,a100,\"h100-8 gpipe 4x2\"": Case(
        covered="tests/test_benchmarks.py::test_fit_table_renders_the_cached_cells_and_marks_the_rest",
        why="GPU columns need the CUDA PJRT plugin (not in the test extra; tests/test_dryrun.py::test_gpu_targets_"
            "compile_where_the_cuda_plugin_is_installed compiles h100-8 where it is); the test takes a --columns "
            "list with a GPipe column"),
    "python -m benchmarks.accelerator_fit --table-only --cache runs/accelerator_fit.json": Case(
        covered="tests/test_benchmarks.py::test_fit_table_renders_the_cached_cells_and_marks_the_rest",
        why="--table-only with a --cache of cells"),
    # --- docs/guide/bottleneck.md
    "python -m experiments.gpt2_wikitext --bottleneck proj:16 --fwd maxabs:3 --bwd maxabs:4:stoch": Case(
        ("--bottleneck", "proj:16", "--fwd", "maxabs:3", "--bwd", "maxabs:4:stoch", *GPT2_TINY),
        expect="fwd maxabs:3, bwd maxabs:4:stoch", slow=True,
        why="a tiny GPT-2 run with a learned bottleneck; by default its --bottleneck errors (tests/test_experiments.py)"
            " and its training on both executors (tests/test_sharded.py) are tested"),
    "python -m experiments.gpt2_wikitext --recipe protocol-cpu --bottleneck ssn --fwd ids+bf16 --bwd ids+bf16 --lr "
    "0.02 --embed-lr 0.525 --head-lr 0.003 --scalar-lr 0.01125": Case(
        ("--recipe", "protocol-cpu", "--bottleneck", "ssn", "--fwd", "ids+bf16", "--bwd", "ids+bf16", "--lr", "0.02",
         "--embed-lr", "0.525", "--head-lr", "0.003", "--scalar-lr", "0.01125", *GPT2_TINY),
        expect="fwd ids+bf16, bwd ids+bf16", slow=True,
        why="a protocol-tiny run with ReparamSSN; by default tests/test_reparam_ssn.py builds it from these "
            "settings and trains it on both executors"),
    # --- docs/results/bottleneck.md
    "python -m experiments.gpt2_wikitext --recipe paper --pretrained gpt2 --bottleneck proj:192 --fwd maxabs:4 "
    "--bwd maxabs:4:stoch --compile-for v5e-1": Case(
        ("--recipe", "paper", "--pretrained", "gpt2", "--bottleneck", "proj:192", "--fwd", "maxabs:4", "--bwd",
         "maxabs:4:stoch", "--compile-for", "v5e-1", "--block-size", "32", "--batch-size", "4", "--train-examples",
         "64", "--train-only"), expect="--compile-for v5e-1: run", slow=True,
        why="compiles GPT-2 small (the size --pretrained gpt2 names; no weights or text are read) for a TPU target; "
            "by default tests/test_dryrun.py compiles for TPU targets"),
    # --- docs/guide/links.md
    "python -m benchmarks.throughput_vs_bandwidth --link 1gbit:20ms,100mbit:20ms": Case(
        ("--link", "1gbit:20ms,100mbit:20ms", "--seq", "8", "--batch", "4", "--repeats", "1", "--methods", "fp32"),
        expect="| 100 Mbps, 20 ms | fp32 |"),
    "python -m benchmarks.throughput_vs_bandwidth --compile-for v5e-8 --model xl": Case(
        covered="tests/test_benchmarks.py::test_throughput_from_a_compiled_target_is_labelled_an_estimate",
        why="--compile-for v5e-8 with the default stages and replicas, the toy model"),
    "python -m benchmarks.real_link --check-link --link 100mbit:20ms": Case(
        covered="tests/test_real_link.py::test_check_link_sees_the_round_trip_and_the_rate",
        why="as root, on namespaces of its own"),
    "python -m benchmarks.real_link --stages S --link LINK --methods METHOD --json sS-LINK-METHOD.json --keep "
    "sS-LINK-METHOD.d": Case(
        covered="tests/test_real_link.py::test_a_train_step_moves_at_most_10_percent_more_than_it_counts",
        why="its fixture runs these flags (S 2, a link with latency, two methods) as root"),
    "python -m benchmarks.real_link --merge s*.json": Case(
        covered="tests/test_real_link.py::test_merged_runs_are_one_table", why="on the fixture's --json"),
    # --- docs/results/throughput.md
    "python -m benchmarks.throughput_vs_bandwidth --compile-for v5e-8 --model xl --stages 8 --data-parallel 1 "
    "--tied-exchange dense,untied,ef+maxabs:4:group=64:scales=group,ef+topk:0.01": Case(
        ("--compile-for", "v5e-8", "--model", "xl", "--stages", "8", "--data-parallel", "1", "--tied-exchange",
         "dense,untied,ef+maxabs:4:group=64:scales=group,ef+topk:0.01", "--model", "small", "--seq", "8",
         "--methods", "fp32"), expect="tied exchange ef+topk:0.01", slow=True,
        why="compiles every op for a TPU target; by default test_throughput_counts_each_choice_of_the_tied_exchange "
            "runs --tied-exchange on the toy model",
        reached_by="tests/test_benchmarks.py::test_throughput_counts_each_choice_of_the_tied_exchange"),
    "python -m benchmarks.throughput_vs_bandwidth --compile-for v5e-8 --model xl --stages 8 --data-parallel 1 --batch "
    "16 --microbatches 16 --schedule gpipe,1f1b,1f1b-fused,zb-h1,interleaved:2 --overlap both --methods "
    "fp32,aqsgd-fw3-bw6,aqsgd-fw2-bw4,top10-q8-reuse,tile64-fw3-bw4": Case(
        ("--compile-for", "v5e-8", "--model", "xl", "--stages", "8", "--data-parallel", "1", "--batch", "16",
         "--microbatches", "16", "--schedule", "gpipe,1f1b,1f1b-fused,zb-h1,interleaved:2", "--overlap", "both",
         "--methods", "fp32,aqsgd-fw3-bw6,aqsgd-fw2-bw4,top10-q8-reuse,tile64-fw3-bw4", "--model", "medium",
         "--seq", "8", "--methods", "fp32,aqsgd-fw2-bw4"), expect="interleaved:2 with overlapped sends", slow=True,
        why="compiles every op for a TPU target; by default test_throughput_from_a_compiled_target_is_labelled_an_"
            "estimate compiles the toy model for v5e-8"),
    "python -m benchmarks.real_link --stages S --link 100mbit:LAT --methods METHOD --json sS-LAT-METHOD.json": Case(
        covered="tests/test_real_link.py::test_a_train_step_moves_at_most_10_percent_more_than_it_counts",
        why="its fixture runs these flags (S 2, a link with latency, two methods) as root"),
    "python -m benchmarks.real_link --stages 2 --link 100mbit:20ms --methods fp32,tile64-fw3-bw4 --batch-size 8 "
    "--train-examples 32 --eval-examples 8 --epochs 1 --microbatches 4 --repeats 2 --rounds 1 [--overlap]": Case(
        covered="tests/test_real_link.py::test_netsim_runs_the_overlapped_table_where_the_run_overlapped_its_sends",
        why="--overlap: netsim's overlapped table and the refusal below 2S microbatches; the stage processes pass "
            "it to the CLI, whose overlapped sends tests/test_sharded_overlap.py checks; the rest of the command is "
            "the fixture's (as root)"),
    # --- docs/results/codec_cost_cpu.md
    "python -m benchmarks.topk_selection --fractions 0.1,0.05,0.03,0.02,0.01 --repeats 7": Case(
        ("--fractions", "0.1,0.05,0.03,0.02,0.01", "--repeats", "7", "--shape", "2,2048"), expect="| 3% |", slow=True,
        why="the default path runs by default"),
    "python -m benchmarks.topk_selection --shape 8,786432 --fractions 0.1,0.03,0.01 --repeats 3": Case(
        ("--shape", "8,786432", "--fractions", "0.1,0.03,0.01", "--repeats", "3", "--shape", "2,2048"), expect="| 1% |",
        slow=True,
        why="a toy --shape for GPT-2 small's example rows"),
    # --- docs/results/pipeline_scale.md
    "python -m benchmarks.pipeline_scale --executors simulate,gpipe,1f1b,1f1b-fused --repeats 2": Case(
        ("--executors", "simulate,gpipe,1f1b,1f1b-fused", "--repeats", "2", "--stages", "2", "--microbatches", "2",
         "--executors", "gpipe", "--seq", "8"), expect="| 2 | 2 | gpipe |", slow=True,
        why="the page's full grid (53 minutes); its default path runs by default"),
    # --- docs/guide/frontier.md
    "python -m experiments.frontier": Case(FRONTIER_TINY, expect="| fp32 |"),
    "python -m experiments.frontier --list-methods": Case(
        covered="tests/test_frontier.py::test_list_methods_names_every_method_with_its_specs",
        why="--list-methods names every method with its specs"),
    "python -m experiments.frontier --recipe protocol-cpu --batch-size 16 --train-examples 3200 --eval-examples 128 "
    "--seeds 3 --steps 100 --methods fp32 --out runs/ttt/budget": Case(
        ("--recipe", "protocol-cpu", "--batch-size", "16", "--train-examples", "3200", "--eval-examples", "128",
         "--seeds", "3", "--steps", "100", "--methods", "fp32", "--out", "runs/ttt/budget", *FRONTIER_TINY,
         "--seeds", "1"), expect="| fp32 |", slow=True,
        why="protocol-tiny's Muon compiles slowly; the frontier's default path runs by default"),
    "python -m experiments.frontier --recipe protocol-cpu --batch-size 16 --train-examples 3200 --eval-examples 128 "
    "--seeds 3 --steps 200 --target-loss 2.0340 --eval-every 10 --stop-at-target --dense-slowdown record --methods "
    "fp32,chan-tile64-fw3-bw4,adapt34-bw4,top10-q8-reuse --out runs/ttt/every10": Case(
        ("--recipe", "protocol-cpu", "--batch-size", "16", "--train-examples", "3200", "--eval-examples", "128",
         "--seeds", "3", "--steps", "200", "--target-loss", "2.0340", "--eval-every", "10", "--stop-at-target",
         "--dense-slowdown", "record", "--methods", "fp32,chan-tile64-fw3-bw4,adapt34-bw4,top10-q8-reuse", "--out",
         "runs/ttt/every10", *FRONTIER_TINY, "--seeds", "1", "--target-loss", "6", "--repeats", "1"),
        expect="x its unmetered step on", slow=True,
        why="fp32 and bf16 on protocol-tiny (Muon compiles slowly) to a target the untrained model reaches (ln 257 < 6), "
            "the link of the record's balance found and the steps timed; by default the time-to-target flags are "
            "checked (tests/test_frontier.py)"),
    # --- docs/results/frontier.md
    "python -m experiments.frontier --seeds 3 --outliers 4:64:1024 --out runs/frontier-outliers --methods "
    "fp32,direct-fw2-bw4,had-fw2-bw4,tile64-fw3-bw4,chan-tile64-fw3-bw4,had-fw3-bw4,adapt34-bw4,tile16-fw3-bw4,"
    "direct-fw4-bw8,aqsgd-fw2-bw4": Case(
        ("--seeds", "3", "--outliers", "4:64:1024", "--out", "runs/frontier-outliers", "--methods",
         "fp32,direct-fw2-bw4,had-fw2-bw4,tile64-fw3-bw4,chan-tile64-fw3-bw4,had-fw3-bw4,adapt34-bw4,tile16-fw3-bw4,"
         "direct-fw4-bw8,aqsgd-fw2-bw4", *FRONTIER_TINY, "--seeds", "1"),
        expect="wrote runs/frontier-outliers/frontier.md"),
    "python -m experiments.boundary_error --fwd hadamard+maxabs:2:group=64:scales=group:stoch --bwd "
    "hadamard+maxabs:4:group=64:scales=group:stoch --warmup-epochs 0 --steps 192 --epochs 6 --train-examples 256 "
    "--eval-examples 128 --batch-size 8 --every 16": Case(
        ("--fwd", "hadamard+maxabs:2:group=64:scales=group:stoch", "--bwd", "hadamard+maxabs:4:group=64:scales=group:stoch",
         "--warmup-epochs", "0", "--steps", "192", "--epochs", "6", "--train-examples", "256", "--eval-examples",
         "128", "--batch-size", "8", "--every", "16", *BOUNDARY_TINY), expect="[boundary_error] fwd hadamard"),
    "python -m benchmarks.quantizer_error --only-recorded --bits 2,3,4 --recorded rec_outliers.npz rec_fp32.npz": Case(
        covered="tests/test_benchmarks.py::test_quantizer_error_outlier_tensors_and_recorded_activations", slow=True,
        why="--recorded on a small file of its own; the documented files come from experiments.boundary_error --save "
            "(docs/results/quantizer_grids.md)"),
    # --- docs/results/quantizer_grids.md
    "python -m experiments.boundary_error --fwd none --bwd none --warmup-epochs 0 --steps 192 --epochs 6 "
    "--train-examples 256 --eval-examples 128 --batch-size 8 --save rec_fp32.npz": Case(
        ("--fwd", "none", "--bwd", "none", "--warmup-epochs", "0", "--steps", "192", "--epochs", "6",
         "--train-examples", "256", "--eval-examples", "128", "--batch-size", "8", "--save", "rec_fp32.npz",
         *BOUNDARY_TINY), expect="[boundary_error] fwd none"),
    "python -m benchmarks.quantizer_error --recorded rec_fp32.npz rec_outliers.npz": Case(
        covered="tests/test_benchmarks.py::test_quantizer_error_outlier_tensors_and_recorded_activations", slow=True,
        why="--recorded on a small file of its own; the documented files come from experiments.boundary_error --save"),
    "python -m experiments.gpt2_wikitext --fwd FWD --bwd BWD --warmup-epochs 1 --seed S --train-examples 256 "
    "--eval-examples 128 --batch-size 8 --steps 192 --epochs 6": Case(
        ("--fwd", "maxabs:2:stoch", "--bwd", "maxabs:4:stoch", "--warmup-epochs", "1", "--seed", "2",
         "--train-examples", "256", "--eval-examples", "128", "--batch-size", "8", "--steps", "192", "--epochs", "6",
         *GPT2_TINY), expect="fwd maxabs:2:stoch, bwd maxabs:4:stoch"),
    # --- docs/results/aqsgd.md
    "python -m benchmarks.aqsgd_drift --fwd aqsgd+maxabs:2:stoch:grid=zero:clip=1 --bwd maxabs:4:stoch:grid=zero:clip=1 "
    "--train-examples 256 --eval-examples 128 --batch-size 8 --epochs 6": Case(
        ("--fwd", "aqsgd+maxabs:2:stoch:grid=zero:clip=1", "--bwd", "maxabs:4:stoch:grid=zero:clip=1",
         "--train-examples", "256", "--eval-examples", "128", "--batch-size", "8", "--epochs", "6", *GPT2_TINY),
        expect="| epoch |"),
    "python -m benchmarks.aqsgd_drift --fwd aqsgd+maxabs:2:stoch:grid=midrise:clip=mse --bwd "
    "maxabs:4:stoch:grid=zero:clip=1 --train-examples 256 --eval-examples 128 --batch-size 8 --epochs 6": Case(
        ("--fwd", "aqsgd+maxabs:2:stoch:grid=midrise:clip=mse", "--bwd", "maxabs:4:stoch:grid=zero:clip=1",
         "--train-examples", "256", "--eval-examples", "128", "--batch-size", "8", "--epochs", "6", *GPT2_TINY),
        expect="| epoch |"),
    # --- docs/results/time_to_target.md
    "python -m experiments.frontier --recipe protocol-cpu --batch-size 16 --train-examples 3200 --eval-examples 128 "
    "--seeds 3 --steps 200 --target-loss 2.0340 --eval-every 20 --stop-at-target --link 27.4mbit:5.7ms --methods "
    + TTT_METHODS + " --out runs/ttt/target": Case(
        ("--recipe", "protocol-cpu", "--batch-size", "16", "--train-examples", "3200", "--eval-examples", "128",
         "--seeds", "3", "--steps", "200", "--target-loss", "2.0340", "--eval-every", "20", "--stop-at-target",
         "--link", "27.4mbit:5.7ms", "--methods", TTT_METHODS, "--out", "runs/ttt/target", *FRONTIER_TINY, "--seeds",
         "1", "--target-loss", "6", "--repeats", "1"), expect="| bf16 |", slow=True,
        why="fp32 and bf16 on protocol-tiny (Muon compiles slowly) to a target the untrained model reaches, timed on "
            "the link; by default the time-to-target flags are checked (tests/test_frontier.py)"),
    "python -m benchmarks.real_link --recipe protocol-cpu --stages 2 --link 798252bit:195.74ms --methods "
    "fp32,top10-q8-reuse,adapt34-bw4,chan-tile64-fw3-bw4 --train-examples 128 --eval-examples 16 --epochs 1 --json "
    "s2.json --keep kept": Case(
        covered="tests/test_real_link.py::test_a_train_step_moves_at_most_10_percent_more_than_it_counts",
        why="as root, its fixture runs --stages 2 on a link with latency with --json and --keep; a recipe's own sizes "
            "unless a flag says: test_a_recipe_runs_at_its_own_sizes_unless_a_flag_says"),
    "python -m experiments.gpt2_wikitext --recipe protocol-cpu --stages 2 --fwd FWD --bwd BWD --warmup-epochs 0 --steps "
    "200 --epochs 1 --batch-size 16 --train-examples 3200 --eval-examples 128 --seed $seed --lr-steps 200 --eval-every "
    "20 --target-loss 2.0340 --stop-at-target --no-progress --out runs/ttt/s2 --run-name NAME": Case(
        covered="tests/test_protocol_gpt.py::test_a_protocol_cpu_run_records_its_step_to_target_and_stops_there",
        slow=True, why="a protocol-cpu run to its target, stopped there (Muon compiles slowly)"),
    # --- docs/results/codecs_compiled.md
    "python -m benchmarks.codec_compiled --targets h100,l4,v5e-1,v6e-1 --out runs/codec_compiled": Case(
        covered="tests/test_codec_compiled.py::test_a_target_fills_every_cell_resumes_and_summarises",
        why="compiles every codec for GPU and TPU targets (about 45 minutes; GPU targets need the CUDA PJRT plugin); "
            "the test fills a toy shape's cells for v5e-1 into --out, resumes and summarises"),
    "python -m benchmarks.codec_compiled --report --targets h100,l4,v5e-1,v6e-1 --out runs/codec_compiled": Case(
        covered="tests/test_codec_compiled.py::test_a_target_fills_every_cell_resumes_and_summarises",
        why="the summary of the cells in --out; the test summarises its own"),
    "python -m benchmarks.device_check --sections provenance,codecs --budget-s 300": Case(
        covered="tests/test_device_check.py::test_sections_past_the_budget_are_skipped_with_the_reason",
        why="a GPU's run; on the CPU --tiny with --budget-s (its --sections in "
            "test_a_failing_step_is_recorded_and_the_next_one_runs)"),
    "python -m experiments.gpt2_wikitext --recipe paper --preset top10-reuse --compile-for v5e-8 --executor sharded "
    "--stages 4 --train-only": Case(
        ("--recipe", "paper", "--preset", "top10-reuse", "--compile-for", "v5e-8", "--executor", "sharded",
         "--stages", "4", "--train-only", "--model", "tiny", "--block-size", "32", "--batch-size", "4",
         "--train-examples", "64"), expect="--compile-for v5e-8: run top10-reuse", slow=True,
        why="compiles GPT-2 small's 4-stage TopK step for a TPU slice (about 4 minutes); by default "
            "tests/test_dryrun.py compiles a sharded step holding the threshold selection for v5e-8"),
    # --- docs/guide/executors.md
    "python -m benchmarks.pipeline_scale --model gpt2-small --stages 4 --microbatches 8 --mb-size 1 --seq 1024 "
    "--executors 1f1b,zb-h1,gpipe --repeats 0": Case(
        ("--model", "gpt2-small", "--stages", "4", "--microbatches", "8", "--mb-size", "1", "--seq", "1024",
         "--executors", "1f1b,zb-h1,gpipe", "--repeats", "0", "--model", "gpt2", "--stages", "2", "--microbatches",
         "2", "--seq", "8", "--executors", "gpipe"), expect="| 2 | 2 | gpipe |"),
    # --- docs/guide/many_hosts.md
    "python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4 --executor sharded --stages 4 --data-parallel 2 "
    "--train-examples 64 --epochs 1 --coordinator 127.0.0.1:8476 --num-processes 2 --process-id $i &": Case(
        covered="tests/test_multiprocess.py::test_cli_runs_on_two_processes", slow=True,
        why="two CLI processes on this machine, one coordinator"),
    "python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4 --executor sharded --stages 4 --data-parallel 2 --out "
    "/shared/runs --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0": Case(
        covered="tests/test_multiprocess.py::test_cli_runs_on_two_processes", slow=True,
        why="one of two hosts; the test runs both processes on this machine"),
    "python -m experiments.gpt2_wikitext --preset top10-reuse --executor sharded --stages 4 --data-parallel 2 --out "
    "/shared/runs": Case(
        ("--preset", "top10-reuse", "--executor", "sharded", "--stages", "4", "--data-parallel", "2", "--out",
         "shared/runs", *GPT2_TINY), slow=True,
        why="the sharded executor on 8 devices; by default 2 x 2 in test_gpipe_executor_from_the_cli"),
    "python -m experiments.resnet_cifar10 --preset fw4-bw8 --executor sharded --stages 4 --data-parallel 2": Case(
        ("--preset", "fw4-bw8", "--executor", "sharded", "--stages", "4", "--data-parallel", "2", *RESNET_TINY),
        slow=True, why="ResNet's sharded executor on 8 devices; the default path runs by default"),
    "python -m experiments.resnet_cifar10 --preset fw4-bw8 --executor sharded --stages 4 --data-parallel 8 --out "
    "gs://BUCKET/runs'": Case(
        covered="tests/test_dryrun.py::test_sharded_executor_compiles_for_a_tpu_slice_and_its_collectives_send_the_"
                "counted_bytes",
        why="32 devices of a TPU pod writing to a bucket (inside gcloud's quoted --command); the sharded executor "
            "compiled for TPU slices"),
    "python -m benchmarks.real_link --rate 100mbit --stages 2 --methods fp32,direct-fw2-bw4": Case(
        covered="tests/test_real_link.py::test_rate_is_the_older_name_of_link",
        why="--rate is --link's older name; the fixture runs these stages and methods as root"),
    # --- docs/guide/papers.md
    "python -m experiments.gpt2_wikitext --recipe pretrain-cpu --run-name kjv": Case(
        ("--recipe", "pretrain-cpu", "--run-name", "kjv", *GPT2_TINY)),
    "python -m experiments.gpt2_wikitext --recipe finetune-cpu --preset aqsgd-fw2-bw4 --pretrained "
    "runs/gpt2_wikitext/kjv": Case(
        covered="tests/test_finetune.py::test_a_run_trained_here_is_fine_tuned_from_its_last_weights_with_a_fresh_"
                "optimizer_at_step_zero",
        why="a run trained here fine-tuned from its folder's newest weights"),
    "python -m experiments.gpt2_wikitext --recipe paper --preset aqsgd-fw3-bw6 --pretrained gpt2-xl --data "
    "wikitext2-raw --stages 8 --executor sharded --schedule 1f1b --microbatches 8 --compile-for h100-8 --train-only":
        Case(covered="tests/test_dryrun.py::test_gpu_targets_compile_where_the_cuda_plugin_is_installed",
             why="compiling for h100-8 needs the CUDA PJRT plugin (the test compiles h100-8 where it is); "
                 "--pretrained gpt2-xl and --data name downloads, which a compile-only run does not read"),
    "python -m experiments.finetune --report": Case(
        covered="tests/test_finetune.py::test_a_one_method_toy_study_runs_and_reports",
        why="the report of a toy study's runs"),
    # --- docs/guide/plan.md
    "python -m experiments.gpt2_wikitext ...": Case(
        covered="tests/test_documented_commands.py::test_documented_command_runs",
        why="the page's pattern for a run of experiments.gpt2_wikitext; each documented one runs there"),
    "python -m experiments.ladder": Case(
        covered="tests/test_ladder.py::test_a_toy_ladder_runs_and_a_rerun_skips_what_finished", slow=True,
        why="hours of training on 2 cores; the toy ladder trains, reports and reruns",
        reached_by="tests/test_ladder.py::test_the_export_writes_the_scratch_regime_and_keeps_the_fine_tuning_one"),
    "python -m experiments.ladder --out DIR": Case(
        covered="tests/test_ladder.py::test_a_toy_ladder_runs_and_a_rerun_skips_what_finished", slow=True,
        why="hours of training on 2 cores; the toy ladder runs into a folder of its own"),
    "python -m experiments.finetune --report --export FILE": Case(
        covered="tests/test_finetune.py::test_the_study_exports_its_inflation_as_the_finetune_regime_and_keeps_the_"
                "table_s_others",
        why="the export into a copy of the shipped table"),
    # --- docs/results/finetune.md
    "python -m experiments.finetune --widths 128 --seeds 3 --out runs/finetune": Case(
        covered="tests/test_finetune.py::test_a_toy_study_pretrains_once_fine_tunes_reports_and_a_rerun_trains_nothing",
        slow=True, why="hours on 2 cores; the toy study at width 16",
        reached_by="tests/test_finetune.py::test_a_one_method_toy_study_runs_and_reports"),
    "python -m experiments.finetune --report --export jaxcomp/data/step_inflation.json": Case(
        covered="tests/test_finetune.py::test_the_study_exports_its_inflation_as_the_finetune_regime_and_keeps_the_"
                "table_s_others",
        why="writes the shipped table; the test exports into a copy of it"),
    # --- docs/results/step_inflation.md
    "python -m experiments.ladder --horizons 100,300,1000 --seeds 3,2,1 --out runs/ladder --methods "
    "fp32,ssn,chan-tile64-fw3-bw4,adapt34-bw4": Case(
        covered="tests/test_ladder.py::test_a_toy_ladder_runs_and_a_rerun_skips_what_finished", slow=True,
        why="days of training on 2 cores; the toy ladder trains, reports and reruns"),
    "python -m experiments.ladder --horizons 100 --widths 64,256 --seeds 2 --out runs/ladder --methods "
    "fp32,ssn,chan-tile64-fw3-bw4,adapt34-bw4,top10-q8-reuse": Case(
        covered="tests/test_ladder.py::test_a_toy_ladder_runs_and_a_rerun_skips_what_finished", slow=True,
        why="hours of training on 2 cores; the toy ladder trains, reports and reruns"),
    "python -m experiments.ladder --report --horizons 100,300,1000 --widths 64,128,256 --out runs/ladder": Case(
        covered="tests/test_ladder.py::test_the_export_writes_the_scratch_regime_and_keeps_the_fine_tuning_one",
        why="--report on toy results of its own"),
    # --- docs/dev/design.md
    "python -m experiments.X": Case(covered="tests/test_documented_commands.py::test_each_module_reaches_its_default_"
                                            "path_by_default", why="the page's pattern for the experiments' commands"),
}
