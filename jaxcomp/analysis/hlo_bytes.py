"""Bytes in a compiled XLA program, read from its HLO text (CPU, GPU and TPU backends).

`collective_bytes`: what the collectives send per call (`collective_permutes`: each collective-permute).
`memory_bytes`: the HBM traffic of a call (every top-level instruction reads its operands and writes its
result; a fusion counts at its boundary, as XLA's own cost analysis does). Both count a loop body once per iteration:
a `while` runs `known_trip_count` times when the backend writes it, else, for the counted
loops JAX emits (`scan`, `fori_loop`), the bound of its condition `i < N` less the counter's
constant start; a loop whose trip count is data-dependent (`lax.while_loop`) is counted once
for memory and refused for collectives. A `conditional` runs one branch per call: collectives
count each branch once, memory the costliest branch.
"""
import dataclasses
import math
import re

import numpy as np

from jaxcomp.parallel.mesh import DATA_EXCHANGE, TIED, WRAPPED

_ARRAY = re.compile(r"(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|f8e4m3fnuz|f8e5m2fnuz|f8e4m3b11fnuz|f8e4m3|f8e3m4)"
                    r"\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}
_LAID_OUT = re.compile(_ARRAY.pattern + r"(?:\{([^}]*)\})?")
_ARRAY_TEXT = re.compile(r"(?:pred|[suf]\d+|bf16|f8\w*)\[[\d,]*\]")
_LAID_OUT_TEXT = re.compile(r"(?:pred|[suf]\d+|bf16|f8\w*)\[[\d,]*\](?:\{[^}]*\})?")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# instructions that move no data of their own (aliases, control, metadata) or whose callees are counted instead
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "copy-done", "slice-done",
               "collective-permute-done", "all-gather-done", "all-reduce-done", "async-done", "send-done",
               "recv-done", "add-dependency", "domain"}


def _itemsize(dtype: str) -> int:
  return _BYTES.get(dtype) or (1 if dtype.startswith("f8") else int(dtype[1:]) // 8)


def array_bytes(text: str) -> int:
  """Bytes of every array type (`f32[2,3]`, ...) written in `text`."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _itemsize(dtype)
  return total


def device_memory_bytes(text: str, any_space: bool = False) -> int:
  """Bytes of the arrays written in `text` that live in device memory (HBM), padded to their
  layout's tiles: `f32[20,100]{1,0:T(8,128)}` takes 24 x 128 floats; arrays placed in another
  memory space (`S(1)`: TPU VMEM, ...) take none, unless `any_space`."""
  total = 0
  for dtype, dims, layout in _LAID_OUT.findall(text):
    shape = [int(d) for d in dims.split(",") if d]
    order, _, tiling = layout.partition(":")
    space = re.search(r"S\((\d+)\)", tiling)
    if space and space.group(1) != "0" and not any_space:
      continue
    tile = re.match(r"T\(([\d,]+)\)", tiling)
    if tile and shape:
      minor_to_major = [int(d) for d in order.split(",") if d]
      physical = minor_to_major[::-1]  # major to minor
      for dim, size in zip(physical[::-1], [int(t) for t in tile.group(1).split(",")][::-1]):
        shape[dim] = -(-shape[dim] // size) * size
    total += int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
  return total


def _closing(text: str, start: int) -> int:
  """Index just past the bracket that closes the one opening at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] in "([{"
    depth -= text[i] in ")]}"
    if depth == 0:
      return i + 1
  return len(text)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: `name = type opcode(operands), attributes`."""
  name: str
  type: str  # result type text: `f32[8,16]{1,0}` or a tuple `(u8[4], u32[])`
  opcode: str
  operands: tuple[str, ...]  # operand instruction names
  attributes: str  # the text after the operand list
  line: str


def parse_instruction(line: str) -> Instruction | None:
  """The instruction a line of HLO text defines, or None."""
  head = _DEFINITION.match(line)
  if head is None:
    return None
  rest = line[head.end():]
  end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
  type_text, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  close = _closing(rest, paren)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:close]))
  return Instruction(head.group(1), type_text, rest[:paren], operands, rest[close:], line)


class Module:
  """A compiled program's computations, their instructions and the types of their values."""

  def __init__(self, hlo_text: str):
    self.computations: dict[str, list[Instruction]] = {}
    self.entry = None
    current = None
    for line in hlo_text.splitlines():
      header = _HEADER.match(line)
      if header and not line.startswith(" "):
        current = header.group(1)
        self.computations[current] = []
        if line.startswith("ENTRY"):
          self.entry = current
      elif current is not None and line.startswith(" "):
        inst = parse_instruction(line)
        if inst is not None:
          self.computations[current].append(inst)
    self.types = {(c, i.name): i.type for c, insts in self.computations.items() for i in insts}
    self.by_name = {(c, i.name): i for c, insts in self.computations.items() for i in insts}

  def callees(self, inst: Instruction) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction calls: body, condition, to_apply, calls, branch."""
    called = _CALLED.findall(inst.attributes)
    for group in _BRANCHES.findall(inst.attributes):
      called += [("branch", c) for c in re.findall(r"%?([\w.\-]+)", group)]
    return called

  def trip_count(self, computation: str, loop: Instruction) -> int | None:
    """Iterations of a `while`: the backend's known_trip_count, else N - c for a condition `i < N`
    whose counter starts at the constant c; None when neither can be read."""
    known = _TRIP.search(loop.attributes)
    if known:
      return int(known.group(1))
    condition = dict(self.callees(loop)).get("condition")
    insts = self.computations.get(condition, [])
    root = next((i for i in insts if i.line.lstrip().startswith("ROOT")), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
      return None
    counter, bound = (self.by_name.get((condition, o)) for o in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.opcode != "constant":
      return None
    index = int(re.search(r"index=(\d+)", counter.attributes).group(1))
    start = self._tuple_element(computation, loop.operands[0], index)
    if start is None or start.opcode != "constant":
      return None
    value = lambda inst: int(re.search(r"constant\((-?\d+)\)", inst.line).group(1))
    return value(bound) - value(start)

  def _tuple_element(self, computation: str, name: str, index: int) -> Instruction | None:
    inst = self.by_name.get((computation, name))
    if inst is None or inst.opcode != "tuple" or index >= len(inst.operands):
      return None
    element = self.by_name.get((computation, inst.operands[index]))
    while element is not None and element.opcode in ("copy", "bitcast") and len(element.operands) == 1:
      element = self.by_name.get((computation, element.operands[0]))  # TPU copies the start into the loop
    return element


def parsed(hlo: "str | Module") -> Module:
  """`hlo` as a `Module`: compiled HLO text is parsed, a `Module` passes through (parse a program once, then
  read its bytes, traffic and overlap from the one parse)."""
  return hlo if isinstance(hlo, Module) else Module(hlo)


@dataclasses.dataclass
class Executions:
  """How often each computation runs per call, and which run under a loop of unknown trip count."""
  counts: dict[str, int]
  uncounted: set[str]  # computations inside a `while` whose trip count could not be read


def executions(module: Module) -> Executions:
  """Runs of each computation per call of the program (loop bodies x trip count; each branch of a
  conditional counted once)."""
  out = Executions({}, set())

  def visit(name, times, uncounted):
    out.counts[name] = out.counts.get(name, 0) + times
    if uncounted:
      out.uncounted.add(name)
    for inst in module.computations.get(name, ()):
      trip = module.trip_count(name, inst) if inst.opcode == "while" else None
      for role, callee in module.callees(inst):
        looped = role in ("body", "condition")
        visit(callee, times * ((trip or 1) if looped else 1), uncounted or (looped and trip is None))

  visit(module.entry, 1, False)
  return out


def _group_size_and_count(line):
  """(members per group, groups) of a collective's replica_groups, in any of XLA's three spellings: an iota
  `[count,size]<=[...]`, a list `{{0,1},{2,3}}`, or named mesh axes `mesh['data'=2,'stage'=4] {'stage'}` (one
  group per point of the axes not named in braces; newer XLA, e.g. libtpu 0.0.50)."""
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2)), int(iota.group(1))
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if mesh:
    axes = {name: int(n) for name, n in re.findall(r"'([^']*)'=(\d+)", mesh.group(1))}
    size = math.prod(axes[name] for name in re.findall(r"'([^']*)'", mesh.group(2)))
    return size, math.prod(axes.values()) // size
  groups = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line).group(1)
  members = re.findall(r"\{([\d,]*)\}", groups)
  return len(members[0].split(",")), len(members)


def _start_parts(type_text: str) -> tuple[str, str]:
  """An async start's type is (operand, result, context...): the texts of its operand and result, each one array
  or, where XLA:GPU combines collective-permutes into one, a tuple of arrays. A start that is not a tuple (XLA:GPU's
  all-reduce-start) is both."""
  if not type_text.strip().startswith("("):
    return type_text, type_text
  inner, parts, depth, start = type_text.strip()[1:-1], [], 0, 0
  for i, c in enumerate(inner + ","):
    depth += (c in "([{") - (c in ")]}")
    if c == "," and depth == 0:
      parts.append(inner[start:i].strip())
      start = i + 1
  return parts[0], parts[min(1, len(parts) - 1)]


@dataclasses.dataclass(frozen=True)
class PermuteSend:
  """One collective-permute of a compiled program: its instruction, runs per call, the bytes it moves per
  source->target pair, and those pairs."""
  inst: Instruction
  runs: int
  bytes_per_pair: int
  pairs: tuple[tuple[int, int], ...]


def collective_permutes(hlo: "str | Module") -> list[PermuteSend]:
  """Every collective-permute (sync or async start) of a compiled program. One in a loop of unknown trip count
  is a ValueError. `hlo`: the compiled program's text, or its `Module`."""
  module = parsed(hlo)
  runs = executions(module)
  out = []
  for name, times in runs.counts.items():
    for inst in module.computations.get(name, ()):
      if inst.opcode.removesuffix("-start") != "collective-permute":
        continue
      if name in runs.uncounted:
        raise ValueError(f"a collective-permute inside a loop without a known trip count: {inst.line.strip()[:160]}")
      moved = array_bytes(inst.type if inst.opcode == "collective-permute" else _start_parts(inst.type)[0])
      pairs = re.findall(r"\{(\d+),(\d+)\}", inst.attributes.split("source_target_pairs=", 1)[1])
      out.append(PermuteSend(inst, times, moved, tuple((int(a), int(b)) for a, b in pairs)))
  return out


def _tuple_parts(type_text: str) -> list[str]:
  """The element types of a tuple type's text (one element: the text itself)."""
  text = type_text.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, c in enumerate(text[1:-1] + ",", start=1):
    depth += (c in "([{") - (c in ")]}")
    if c == "," and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  return parts


def _exchanged_bytes(module: Module, computation: str, inst: Instruction) -> int:
  """Bytes of one member's operands of an all-reduce(-start) that the scope `DATA_EXCHANGE` issued. XLA combines
  small all-reduces into one of a tuple: then each element's get-tuple-element (of the all-reduce, or of the
  all-reduce-done of a start) keeps the scope of the all-reduce it came from."""
  if not inst.type.strip().startswith("("):
    return array_bytes(inst.type) if f"/{DATA_EXCHANGE}/" in inst.line else 0
  holders = {inst.name} | {i.name for i in module.computations[computation]
                           if i.opcode == "all-reduce-done" and i.operands == (inst.name,)}
  parts = _tuple_parts(next(module.types[(computation, h)] for h in holders if h != inst.name)
                       if len(holders) > 1 else inst.type)
  total = 0
  for user in module.computations[computation]:
    if user.opcode == "get-tuple-element" and user.operands[0] in holders and f"/{DATA_EXCHANGE}/" in user.line:
      total += array_bytes(parts[int(re.search(r"index=(\d+)", user.attributes).group(1))])
  return total


def collective_bytes(hlo: "str | Module", num_stages: int | None = None) -> dict[str, int]:
  """Bytes the collectives of a compiled program send per call, summed over all devices.

  Devices are numbered as a (data, stage) mesh lists them: d * num_stages + s. Each
  collective-permute moves its operand once per source->target pair: a pair within one data
  row is a pipeline message, forward (activations) from stage a to a+1, backward (gradients)
  from a+1 to a (under the scope `WRAPPED`, a ring's wrap-around link: forward from the higher
  device to the lower); a pair across data rows is the data-parallel exchange (`data`; without
  `num_stages` every pair is a pipeline message); a collective-permute issued under the scope
  `TIED` is the tied-parameter exchange (`tied`, a key present only when the program has one).
  Each all-gather over a group of n also counts as `data`: every member's operand (result / n)
  to the n-1 others; so does an all-reduce issued under the scope `DATA_EXCHANGE` (the dense
  data-parallel exchange; of an all-reduce XLA combined from several, the parts that scope issued), as a
  ring all-reduce sends it: 2 (n-1)/n of its operand from each of the n members. Other all-reduces
  (scalars: losses, norms) are not counted. A collective in a loop of
  unknown trip count is a ValueError. `hlo`: the compiled program's text, or its `Module`.
  """
  module = parsed(hlo)
  runs = executions(module)
  totals = {"fwd": 0, "bwd": 0, "data": 0}
  for name, times in runs.counts.items():
    for inst in module.computations.get(name, ()):
      kind = inst.opcode.removesuffix("-start")
      if kind not in ("all-gather", "all-reduce"):
        continue
      if name in runs.uncounted:
        raise ValueError(f"a {kind} inside a loop without a known trip count: {inst.line.strip()[:160]}")
      size, count = _group_size_and_count(inst.line)
      if kind == "all-reduce":
        totals["data"] += times * 2 * (size - 1) * _exchanged_bytes(module, name, inst) * count
        continue
      # the gathered result: the sync op's type, the last array of an async start's
      gathered = array_bytes(inst.type if inst.opcode == kind else _ARRAY_TEXT.findall(inst.type)[-1])
      totals["data"] += times * (gathered // size * (size - 1) * size * count)
  for send in collective_permutes(module):
    if f"/{TIED}/" in send.inst.line:
      totals["tied"] = totals.get("tied", 0) + send.runs * send.bytes_per_pair * len(send.pairs)
      continue
    wrapped = f"/{WRAPPED}/" in send.inst.line
    for src, dst in send.pairs:
      same_row = num_stages is None or src // num_stages == dst // num_stages
      totals[("fwd" if (dst > src) != wrapped else "bwd") if same_row else "data"] += send.runs * send.bytes_per_pair
  return totals


_SLICING = ("dynamic-slice", "slice", "gather")  # read of operand 0: only what the result holds
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # operand 0 updated in place: write the update operand


def _readers(users, name) -> list[tuple[Instruction, bool]]:
  """(instruction, whether `name` is its first operand) for every instruction that reads `name`,
  looking through bitcasts (which move no data)."""
  out = []
  for user in users.get(name, ()):
    out += _readers(users, user.name) if user.opcode == "bitcast" else [(user, user.operands[0] == name)]
  return out


def _instruction_traffic(module: Module, computation: str, inst: Instruction) -> int:
  """Device-memory bytes one top-level instruction reads and writes (see `memory_bytes`)."""
  operand_types = [module.types.get((computation, o), "") for o in inst.operands]
  if inst.opcode in _SLICING:
    return 2 * device_memory_bytes(inst.type) + sum(device_memory_bytes(t) for t in operand_types[1:])
  if inst.opcode in _IN_PLACE:
    update = operand_types[_IN_PLACE[inst.opcode]]
    return sum(device_memory_bytes(t) for t in operand_types[1:]) + device_memory_bytes(update)
  if inst.opcode == "copy-start":  # (destination, source, context): reads the source, writes the destination
    destination, source = _start_parts(inst.type)
    return device_memory_bytes(destination) + device_memory_bytes(source)
  if inst.opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in inst.attributes:
    return 0  # an uninitialised buffer (XLA:TPU): its writers count what goes in
  if inst.opcode.endswith("-start"):
    result = _start_parts(inst.type)[1]
    if inst.opcode == "slice-start":  # an async slice (TPU: into VMEM) reads only the slice
      return device_memory_bytes(result) + device_memory_bytes(result, any_space=True)
    return device_memory_bytes(result) + sum(device_memory_bytes(t) for t in operand_types)
  if inst.opcode != "fusion":
    return device_memory_bytes(inst.type) + sum(device_memory_bytes(t) for t in operand_types)
  fused_name = dict(module.callees(inst)).get("calls")
  fused = module.computations.get(fused_name, [])
  users: dict[str, list] = {}
  for i in fused:
    for operand in i.operands:
      users.setdefault(operand, []).append(i)
  params = {int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name for i in fused if i.opcode == "parameter"}
  read = 0
  for index, outer in enumerate(operand_types):
    readers = _readers(users, params[index]) if index in params else []
    if not device_memory_bytes(outer) or (readers and all(r.opcode in _IN_PLACE and first for r, first in readers)):
      continue  # not in device memory, or the buffer a dynamic-update-slice writes in place
    sliced = readers and all(r.opcode in _SLICING and first for r, first in readers)
    read += sum(device_memory_bytes(r.type, any_space=True) for r, _ in readers) if sliced else device_memory_bytes(outer)
  root = next(i for i in fused if i.line.lstrip().startswith("ROOT"))
  outputs = [module.by_name[(fused_name, o)] for o in root.operands] if root.opcode == "tuple" else [root]
  results = _LAID_OUT_TEXT.findall(inst.type) if root.opcode == "tuple" else [inst.type]
  write = sum(device_memory_bytes(module.types[(fused_name, out.operands[_IN_PLACE[out.opcode]])], any_space=True)
              if out.opcode in _IN_PLACE else device_memory_bytes(result) for out, result in zip(outputs, results))
  return read + write


def memory_bytes(hlo: "str | Module", unknown_trips: int = 1) -> int:
  """Bytes one call reads and writes in device memory (`device_memory_bytes`: tile-padded, HBM only),
  per top-level instruction: its operands and result, as XLA's cost analysis counts them; a fusion at
  its boundary, where an operand only sliced inside (dynamic-slice, gather: a scanned layer's weights,
  a table's rows) counts the slices and a result updated in place (dynamic-update-slice, scatter)
  counts the update; an async start its operand and result (a copy-start, XLA:TPU's prefetch into or eviction
  from VMEM, its source and destination; an AllocateBuffer nothing). Loop bodies x trip count (`unknown_trips`
  times where it is data-dependent), the costliest branch of a conditional. On a loop-free CPU program this is XLA's own
  "bytes accessed" within 1%. `hlo`: the compiled program's text, or its `Module`."""
  module = parsed(hlo)
  memo: dict[str, int] = {}

  def inst_bytes(computation, inst):
    return _instruction_traffic(module, computation, inst)

  def cost(name):
    if name not in memo:
      total = 0
      for inst in module.computations.get(name, ()):
        called = module.callees(inst)
        if inst.opcode == "while":
          total += (module.trip_count(name, inst) or unknown_trips) * sum(cost(c) for _, c in called)
        elif inst.opcode == "conditional":
          total += max((cost(c) for role, c in called if role in ("branch", "true_computation", "false_computation")),
                       default=0)
        elif inst.opcode in ("call", "async-start"):
          total += sum(cost(c) for _, c in called)
        elif inst.opcode not in _NO_TRAFFIC:
          total += inst_bytes(name, inst)
      memo[name] = total
    return memo[name]

  return cost(module.entry)
