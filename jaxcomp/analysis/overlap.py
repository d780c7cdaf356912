"""Whether a compiled program's boundary messages cross their links while it computes, read from its HLO text.

In a scheduled module a computation's instructions are listed in the order they run. An asynchronous
collective-permute is a `collective-permute-start` and the `collective-permute-done` that consumes it: the
transfer is in flight between the two, and the compute the scheduler placed between them (a fusion,
convolution, dot or custom-call, or a call, conditional or loop holding one) runs while it is. Of those, the
ones that hold a matrix multiply (a dot or convolution, at any depth) are a stage's layers rather than the
small elementwise fusions a codec or a buffer update leaves. A synchronous `collective-permute` (XLA:CPU,
whose collectives block) overlaps nothing.

A boundary message is a permute the pipeline issues (not the tied-parameter exchange, `mesh.TIED`); it is
in the tick loop when it was traced inside a loop body (JAX's `while/body` scope in its metadata: the scanned
steady ticks), else in the unrolled fill and drain ticks.
"""
import dataclasses
import re

from jaxcomp.analysis import hlo_bytes
from jaxcomp.parallel.mesh import TIED

COMPUTE_OPCODES = frozenset({"fusion", "convolution", "dot", "custom-call"})
MATMUL = frozenset({"convolution", "dot"})
_CALLING = frozenset({"call", "conditional", "while", "async-start"})
_SCOPE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Permute:
  """One collective-permute of a program and the compute ops scheduled while it is in flight."""
  computation: str
  name: str
  in_loop: bool  # traced inside a loop body (the pipeline's scanned ticks)
  tied: bool  # the tied-parameter exchange, not a boundary message
  compute_between: int  # compute ops between its start and its done (0: synchronous)
  matmuls_between: int  # of those, the ones holding a dot or convolution


@dataclasses.dataclass(frozen=True)
class Overlap:
  """Boundary permutes with compute (and with a matrix multiply) between start and done, of those in the tick loop
  and of those in the unrolled ticks."""
  loop_overlapped: int
  loop_matmul: int
  loop: int
  unrolled_overlapped: int
  unrolled_matmul: int
  unrolled: int

  def text(self) -> str:
    return (f"overlap: {self.loop_overlapped} of {self.loop} boundary permutes have compute between start and done"
            f" ({self.loop_matmul} a matrix multiply; in the tick loop; the unrolled fill and drain ticks: "
            f"{self.unrolled_overlapped} of {self.unrolled}, {self.unrolled_matmul} a matrix multiply)")


def permutes(hlo: "str | hlo_bytes.Module") -> list[Permute]:
  """Every collective-permute of a compiled program (its text or `hlo_bytes.Module`), with the compute scheduled
  between its start and done."""
  module = hlo_bytes.parsed(hlo)
  held: dict[tuple[str, frozenset], bool] = {}

  def holds(computation: str, ops: frozenset) -> bool:
    """Whether `computation`, or one it calls, holds one of `ops`."""
    if (computation, ops) not in held:
      held[computation, ops] = False  # a computation never calls itself; the guard keeps a malformed text finite
      held[computation, ops] = any(i.opcode in ops or any(holds(c, ops) for _, c in module.callees(i))
                                   for i in module.computations.get(computation, ()))
    return held[computation, ops]

  def is_compute(inst: hlo_bytes.Instruction) -> bool:
    return inst.opcode in COMPUTE_OPCODES or (inst.opcode in _CALLING
                                              and any(holds(c, COMPUTE_OPCODES) for _, c in module.callees(inst)))

  def has_matmul(inst: hlo_bytes.Instruction) -> bool:
    return inst.opcode in MATMUL or any(holds(c, MATMUL) for _, c in module.callees(inst))

  found = []
  for computation, insts in module.computations.items():
    for k, inst in enumerate(insts):
      if inst.opcode == "collective-permute":
        between = []
      elif inst.opcode == "collective-permute-start":
        done = next((j for j in range(k + 1, len(insts))
                     if insts[j].opcode == "collective-permute-done" and inst.name in insts[j].operands), len(insts))
        between = [i for i in insts[k + 1:done] if is_compute(i)]
      else:
        continue
      scope = _SCOPE.search(inst.line)
      scope = scope.group(1) if scope else ""
      found.append(Permute(computation, inst.name, "/while/body/" in scope, f"/{TIED}/" in scope,
                           len(between), sum(map(has_matmul, between))))
  return found


def overlap(hlo: "str | hlo_bytes.Module") -> Overlap:
  """How many of a program's boundary permutes have compute between start and done (`Overlap`)."""
  boundary = [p for p in permutes(hlo) if not p.tied]
  count = lambda ps: (sum(p.compute_between > 0 for p in ps), sum(p.matmuls_between > 0 for p in ps), len(ps))
  return Overlap(*count([p for p in boundary if p.in_loop]), *count([p for p in boundary if not p.in_loop]))
