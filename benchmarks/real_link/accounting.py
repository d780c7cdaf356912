"""What the marks say: every byte the processes sent, by what sent it (a train step's messages and exchanges, the
rest of each epoch), and netsim's steps/s for the run from the op times its processes measured."""
from benchmarks.real_link.processes import Run
from jaxcomp.analysis import netsim
from jaxcomp.analysis.link import Link
from jaxcomp.parallel import schedules

def split_epochs(events: list[dict]) -> list[dict]:
  """One process's marks -> per epoch {"steps": [step marks], "eval_on", "eval_off", "checkpoint", "saved"}."""
  epochs = []
  for e in events:
    kind = e["label"].split(":")[0]
    if kind == "step":
      if not epochs or "eval_on" in epochs[-1]:
        epochs.append({"steps": []})
      epochs[-1]["steps"].append(e)
    elif kind in ("eval_on", "eval_off", "checkpoint", "saved"):
      epochs[-1][kind] = e
  return epochs


class Accounting:
  """Every byte the processes of one run sent (htb class counters), by what sent it."""

  def __init__(self, run: Run):
    per_process = [split_epochs(m) for m in run.marks]
    processes = range(len(per_process))
    sent = lambda pick: sum(sum(pick(i)["sent"].values()) for i in processes)
    start, last = (lambda i: run.marks[i][0]), (lambda i: run.marks[i][-1])
    end = lambda i: next(m for m in run.marks[i] if m["label"] == "end")
    self.epochs = []
    for e in range(len(per_process[0])):
      ep = lambda i, key, e=e: per_process[i][e][key]
      n = run.history[e]["epoch_batches"]
      following = (lambda i, e=e: per_process[i][e + 1]["steps"][0]) if e + 1 < len(per_process[0]) else end
      steady = lambda i: ep(i, "steps")[1] if n > 1 else ep(i, "eval_on")
      links = {(i, int(j)): (ep(i, "eval_on")["sent"][j] - steady(i)["sent"][j]) / max(n - 1, 1)
               for i in processes for j in ep(i, "eval_on")["sent"]}
      self.epochs.append({
          "steps": n, "links": links, "step": sum(links.values()) if n > 1 else float("nan"),
          "first_step": sent(steady) - sent(lambda i: ep(i, "steps")[0]),
          "eval_on": sent(lambda i: ep(i, "eval_off")) - sent(lambda i: ep(i, "eval_on")),
          "eval_off": sent(lambda i: ep(i, "checkpoint")) - sent(lambda i: ep(i, "eval_off")),
          "checkpoint": sent(lambda i: ep(i, "saved")) - sent(lambda i: ep(i, "checkpoint")),
          "results": sent(following) - sent(lambda i: ep(i, "saved")),
      })
    self.startup = sent(lambda i: per_process[i][0]["steps"][0]) - sent(start)
    self.timing = sent(last) - sent(end)  # the op timing after the run (its barriers): not the run's
    self.exit = sum(run.sent.values()) - (sent(last) - sent(start))
    self.total = sum(run.sent.values()) - self.timing
    self.step_bytes = sum(ep["steps"] * ep["step"] for ep in self.epochs)

  @property
  def other_per_epoch(self) -> float:
    """Bytes that are not train-step bytes (each epoch's steady step bytes x its steps), per epoch."""
    return (self.total - self.step_bytes) / len(self.epochs)


def step_collectives(table, data: int, clips: bool) -> list:
  """The collectives over the devices that a train step of the sharded executor runs besides its boundary messages
  and the tied exchange, as its compiled programs order them (2 and 4 stages, 1 microbatch: docs/guide/links.md):
  the loss and metrics all-reduce over the stages at the tick of the last chunk's last backward, before that
  tick's messages (then the mean over the replicas), the clipping norm's all-reduce over the stages before the
  update (when the run clips: the GPT-2 recipes do, the protocol ones do not), and after the update the driver's
  `train.all_finite` over every device: gloo's ring all-reduces of a scalar."""
  last = max(t for t in range(table.ticks) for row in table.ops for op in row[t]
             if op.chunk == table.num_chunks - 1 and op.kind != "F")
  losses = [netsim.Collective(last)] + ([netsim.Collective(last, ranks=data)] if data > 1 else [])
  clipping = [netsim.Collective("before_update")] if clips else []
  return [*losses, *clipping, netsim.Collective("after_update", ranks=table.num_devices * data)]


def netsim_steps_per_s(times: list[dict], record: dict, link_bytes: float, config: dict, link: Link) -> float:
  """netsim's steps/s for one epoch of a run of `config` (its stages, replicas, microbatches, schedule and clipping,
  as the run resolved them), on the executor's ticks (with its overlapped sends where the run had them): each stage's
  forward and backward with the codec work of its ends (none in a dense warm-up epoch) and its update, as the
  processes measured them (`times`: one round's, per process; replicas averaged); each message's counted bytes,
  and the tied-parameter exchange's, scaled by the epoch's link bytes / counted bytes (headers, ACKs); each link
  direction at `link`'s rate and latency, with the step's collectives (`step_collectives`), under gloo's
  rendezvous protocol (`jaxcomp.analysis.wires`), and the step's exchanges (`step_exchanges`)."""
  stages, m, d = config["stages"], config["microbatches"], config["data_parallel"]
  dense = record["mode"] == "warmup"
  per_stage = [[t for t in times if t["stage"] == s] for s in range(stages)]
  mean = lambda s, pick: sum(pick(t) for t in per_stage[s]) / len(per_stage[s])
  codec = lambda s, side, way: 0.0 if dense else mean(s, lambda t: t.get(side, {}).get(way, 0.0))
  fwd_s = [mean(s, lambda t: t["fwd"]) + codec(s, "sender", "fwd") + codec(s, "receiver", "fwd") for s in range(stages)]
  bwd_s = [mean(s, lambda t: t["bwd"]) + codec(s, "sender", "bwd") + codec(s, "receiver", "bwd") for s in range(stages)]
  scale = link_bytes / counted_bytes(record)
  message = lambda key: scale * record[f"wire_bytes_{key}"] / (m * d * (stages - 1))
  exchange, tied = step_exchanges(record, scale, stages, d)
  table = schedules.parse(config["schedule"], config.get("overlap", False)).train_table(stages, m)
  timeline = netsim.simulate_step(fwd_s, bwd_s, [message("fwd")] * (stages - 1), [message("bwd")] * (stages - 1), m,
                                  link, exchange=exchange, tied=tied, schedule=table, ticks=True,
                                  update_s=[mean(s, lambda t: t["update"]) for s in range(stages)],
                                  collectives=step_collectives(table, d, config["grad_clip"] is not None),
                                  protocol="rendezvous")
  return 1 / timeline.makespan


def step_exchanges(record: dict, scale: float, stages: int, d: int):
  """netsim's data-parallel exchange and tied-parameter swap of one train step of a run with `stages` stages and
  `d` replicas, from its epoch's record: its counted `wire_bytes_data` (a ring of 2 (d - 1) messages, each stage
  device sending its share) and `wire_bytes_tied` (each replica's first and last stage send each other half),
  times `scale` (link bytes / counted bytes). The swap starts when both ends are ready, after the exchange (the
  executor ties after the mean), and pays two latencies: the first stage reaches it last, its own send leaves
  at once, but its receive's notice must cross before the last stage's bytes leave. (None, None): neither."""
  data = scale * record.get("wire_bytes_data", 0) / (stages * d)  # per stage device
  tied = scale * record.get("wire_bytes_tied", 0) / (2 * d)  # each way, per replica
  exchange = netsim.Exchange([data] * stages, 2 * (d - 1)) if data else None
  return exchange, (netsim.Tied([(0, stages - 1)], [tied], messages=2) if tied else None)


def counted_bytes(record: dict) -> int:
  """Wire bytes one train step sends by the driver's count (every `wire_bytes_*` of the epoch's record)."""
  return sum(v for k, v in record.items() if k.startswith("wire_bytes_"))

