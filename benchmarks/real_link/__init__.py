"""Pipeline stages as processes talking through a shaped network: steps/s and every byte on the links.

`python -m benchmarks.real_link [--link 100mbit:20ms|unshaped] [--stages 2] [--data-parallel 1]
    [--methods fp32,direct-fw2-bw4,...] [--recipe tiny|protocol-cpu|...] [--epochs 2] [--json PATH]`   (as root)
`python -m benchmarks.real_link --merge A.json B.json ...`   (runs of one method each, as one table)

The network. Each process gets its own network namespace, joined by a veth pair to a bridge in a
hub namespace the benchmark creates (addresses 10.77.0.i+1/24, nothing routed out of them). Each
process's egress is an htb qdisc with one class per peer (u32 filter on the destination address)
at `--rate`: every direction of every process pair is shaped on its own (full duplex), and its
class counter says how many bytes crossed it (Ethernet, IP and TCP headers and ACKs included,
each TCP segment's own, as on a wire of MTU 1500). `unshaped` keeps the classes (for their
counters) at 100gbit. Namespaces and interfaces are removed when the benchmark ends, fails or is
interrupted (SIGINT, SIGTERM, SIGHUP).

The run. For each method (a name of `jaxcomp.methods`, or a GPT-2 preset), one process
per stage x data-parallel replica runs the experiment CLI (`experiments.gpt2_wikitext`, `--recipe`:
tiny by default, at this benchmark's sizes `TINY_SIZES`; another recipe at its own sizes, the size flags
given overriding either) with its own multi-process flags (`--coordinator --num-processes --process-id`,
`--executor sharded --stages S`; the recipe's schedule, with `--overlap` its overlapped sends), JAX_PLATFORMS=cpu
and one CPU device per process, process i pinned to core i mod cores (`taskset`; with more processes than cores,
processes share cores).
Each process runs in its own UTS namespace with its address as host name, so that gloo (JAX's CPU
collectives) binds to the process's link. A process runs the CLI's `main` unchanged, with marks
around the driver's calls: before the first two train steps of every epoch, each evaluation and
each checkpoint it reads its htb class counters. From the marks of all processes:
- link bytes per train step: steps 2..n of the epoch (everything a step puts on the links: the
  payloads, the tied-parameter exchange, the collectives of loss, clipping and the driver's
  finiteness check, headers, ACKs), against the bytes the driver counts (`wire_bytes_*`);
- other link bytes per epoch: everything else (start-up, evaluation with compression on and off,
  checkpoint, exit) over the run, per epoch, itemised in the markdown output;
- steady-state steps/s: the CLI's own figure for the epoch (its first, compiling step excluded);
- netsim's steps/s for the same setting (`netsim_steps_per_s`), from the stage, codec and update
  times each process measures of its own stage after training (same core, the executor's own
  stage programs; the processes take turns, each timing alone while the others wait, as a step of one
  microbatch computes one stage at a time), against steps/s measured beside them
  (`replayed_steps_per_s`): after training the processes run the epoch's recorded train steps again
  (as the driver's loop does: the step, its loss read back, the finiteness check), alternating with
  the op timing for `--rounds` rounds; both are medians over the rounds. This shared machine's speed
  drifts by up to a third from one minute to the next (one stage's backward measured 0.25 s and 0.41 s
  in one run), so netsim is checked against steps timed in the same minutes as its inputs, not the
  epoch's figure from a minute before.
The rows are the last epoch's, and for a method with a dense warm-up epoch (AQ-SGD) that
epoch's too (`METHOD (warm-up)`). After the op timing each process also measures, alone, the
bytes of one `train.all_finite`, one scalar all-reduce and one second of idling.

Modules by role: `network` (namespaces, shaping, the delay line, class counters, the link check), `stage` (one
stage process: the CLI with a `hooks.Hook` that marks its events, op timing, replay, trace, probes), `processes`
(one method's processes on the network), `accounting` (what the marks say: bytes by what sent them, netsim's
steps/s), `command` (the table and the command line).
"""
