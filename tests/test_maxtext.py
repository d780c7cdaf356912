"""jaxcomp inside MaxText's pipeline (`jaxcomp.integrations.maxtext`), on a mesh of 4 fake CPU devices.

The procedure is MaxText's own pipeline test (AI-Hypercomputer/maxtext, tests/unit/pipeline_parallelism_test.py,
`assert_pipeline_same_output_and_grad`), written anew for maxtext 0.2.5: a `Pipeline` of `SimpleDecoderLayer`s
against the same layers run one after another on random inputs, the loss |outputs - random targets| and its
gradients with respect to the layers' weights, for its four configurations: non-circular (4 stages, 4 layers, 4
microbatches), circular (8 layers in 2 repeats, 4 and 8 microbatches) and delayed activation forwarding (8 layers,
8 microbatches). Here the pipeline runs inside `patch_pipeline`: with `none/none` bit for bit unpatched MaxText;
with `maxabs:16` both ways MaxText's check itself (loss within rtol 1e-2, every gradient element within rtol 1e-1);
with `maxabs:8` the loss within it and the gradients as a vector, not element by element (see that test); its
compiled stage permutes carrying exactly the codec's bytes. Then
MaxText's training loop (`examples/maxtext_train.py`).

maxtext needs Python >= 3.12 (`pip install -e '.[maxtext]'`): without it these tests skip, saying so, except
under JAXCOMP_REQUIRE_MAXTEXT=1 (`.ci/run`'s Python 3.12 lane), where a missing maxtext fails the run.
"""
import contextlib
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.integrations import maxtext as jaxcomp_maxtext

from benchmarks.common import xla_flags_with_devices as subprocess_xla_flags

try:
  import maxtext
  from flax import linen as nn
  from flax import nnx
  from maxtext.common.common_types import MODEL_MODE_TRAIN
  from maxtext.configs import pyconfig
  from maxtext.layers import pipeline
  from maxtext.models import simple_layer
except ImportError as missing:
  if os.environ.get("JAXCOMP_REQUIRE_MAXTEXT") == "1":
    pytest.fail(f"JAXCOMP_REQUIRE_MAXTEXT=1 but maxtext is not importable: {missing!r}; pip install -e '.[maxtext]' "
                "(Python >= 3.12)", pytrace=False)
  pytest.skip(f"maxtext is not importable ({missing}); pip install -e '.[maxtext]' on Python >= 3.12",
              allow_module_level=True)

STAGES = 4
CONFIGS = {  # MaxText's test's four configurations: layers, microbatches, delayed forwarding
    "non_circular": dict(base_num_decoder_layers=4, num_pipeline_microbatches=4),
    "circular_minimum_microbatches": dict(base_num_decoder_layers=8, num_pipeline_microbatches=4),
    "circular_extra_microbatches": dict(base_num_decoder_layers=8, num_pipeline_microbatches=8),
    "delay_activation_forwarding": dict(base_num_decoder_layers=8, num_pipeline_microbatches=8,
                                        pipeline_delay_activation_forwarding=True),
}


@functools.cache
def _case(name):
  """(config, mesh, loss of the pipeline, loss of the layers one after another, weights, inputs, targets)."""
  config = pyconfig.initialize(
      [sys.argv[0], os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")],
      run_name=name, base_output_directory=os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxcomp_maxtext_test"),
      enable_checkpointing=False, enable_goodput_recording=False, max_target_length=128, base_emb_dim=28,
      per_device_batch_size=4, ici_pipeline_parallelism=STAGES, ici_data_parallelism=1, ici_fsdp_parallelism=1,
      **CONFIGS[name])
  shape = [STAGES if axis == "stage" else 1 for axis in config.mesh_axes]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:STAGES]).reshape(shape), config.mesh_axes)
  batch, length, width = config.global_batch_size_to_train_on, config.max_target_length, config.emb_dim
  inputs = jax.random.normal(jax.random.key(2), (batch, length, width))
  targets = jax.random.normal(jax.random.key(3), (batch, length, width))
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  segments = jnp.ones((batch, length), jnp.int32)
  args = (True, MODEL_MODE_TRAIN)  # deterministic, model mode

  stage = lambda rngs: simple_layer.SimpleDecoderLayer(config, mesh, MODEL_MODE_TRAIN, rngs=rngs)
  pipe = pipeline.create_pipeline(config, layers=stage, mesh=mesh)
  layer = simple_layer.SimpleDecoderLayerToLinen(config=config, mesh=mesh, model_mode=MODEL_MODE_TRAIN,
                                                 rngs=nnx.Rngs(params=0))
  with _on(config, mesh):
    weights = pipe.init(jax.random.key(0), inputs, segments, positions, *args)

  def pipeline_loss(weights):
    return jnp.linalg.norm(pipe.apply(weights, inputs, segments, positions, *args) - targets)

  def sequential_loss(weights):  # [repeats, stages, D, D] -> [layers, D, D]: layer r * stages + s
    stacked = nn.unbox(weights)["params"]["layers"]["weights"].reshape(-1, width, width)
    x = inputs
    for w in stacked:
      x, _ = layer.apply({"params": {"weights": w}}, x, positions, segments, *args)  # (y, None): scan_layers
    return jnp.linalg.norm(x - targets)

  return config, mesh, pipeline_loss, sequential_loss, weights


def _on(config, mesh):
  """MaxText's context for its layers: the mesh and its logical axis rules (as its train loop sets them)."""
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(config.logical_axis_rules))
  return stack


@functools.cache
def _compiled(name, loss, patch):
  """The loss's value_and_grad compiled (inside `patch_pipeline(*patch)` unless patch is None) and run; once per
  configuration, loss and patch (the tests below share the unpatched and `none/none` programs)."""
  config, mesh, *_, weights = _case(name)
  with _on(config, mesh), (jaxcomp_maxtext.patch_pipeline(*patch) if patch else contextlib.nullcontext()):
    compiled = jax.jit(jax.value_and_grad(loss)).lower(weights).compile()
    return compiled, compiled(weights)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(tree)])


@pytest.mark.parametrize("name", CONFIGS)
def test_none_is_maxtext_bit_for_bit(name):
  """fwd="none", bwd="none": the loss and every gradient bitwise those of unpatched MaxText."""
  pipeline_loss = _case(name)[2]
  _, (value, grads) = _compiled(name, pipeline_loss, None)
  _, (value_none, grads_none) = _compiled(name, pipeline_loss, ("none", "none"))
  assert np.asarray(value).tobytes() == np.asarray(value_none).tobytes()
  assert _flat(grads).tobytes() == _flat(grads_none).tobytes()


def _within(value, grads, value_ref, grads_ref) -> dict:
  """MaxText's test's check of a pipeline against the layers one after another, and how far it is from holding:
  `holds`: its own calls, `allclose(value, rtol=1e-2)` and `allclose(gradients, rtol=1e-1)` (default atol);
  `loss`: the loss's relative error; `outside`: the fraction of gradient elements outside its tolerance, `worst`:
  their largest relative error; `norm`: the gradient's as a vector, |g - g_ref| / |g_ref|."""
  g, g_ref = _flat(grads), _flat(grads_ref)
  holds = bool(jnp.allclose(value, value_ref, rtol=1e-2)) and bool(jnp.allclose(g, g_ref, rtol=1e-1))
  outside = ~np.isclose(g, g_ref, rtol=1e-1)
  return {"holds": holds, "loss": abs(float(value) / float(value_ref) - 1), "outside": outside.mean(),
          "worst": np.max(np.abs(g - g_ref) / np.abs(g_ref)), "norm": np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref)}


@pytest.mark.parametrize("name", CONFIGS)
def test_maxtext_check_against_the_layers_one_after_another(name):
  """MaxText's check (`_within`) holds for unpatched MaxText and, with jaxcomp inside, for `maxabs:16` both ways.
  With `maxabs:8` the loss holds it and the gradient vector holds its 1e-1 as a whole (2-norm of the error / 2-norm
  of the gradient), but not every element does: near-zero elements (sums that cancel) err by more than 10%, as they
  do with a `bf16` cast (docs/guide/integrate.md gives how many); and each codec acted (not bitwise MaxText's result)."""
  _, _, pipeline_loss, sequential_loss, weights = _case(name)
  reference = jax.jit(jax.value_and_grad(sequential_loss))(weights)
  _, dense = _compiled(name, pipeline_loss, None)
  figures = {"MaxText": _within(*dense, *reference)}
  for spec in ("maxabs:16", "maxabs:8", "bf16"):
    _, compressed = _compiled(name, pipeline_loss, (spec, spec))
    figures[spec] = _within(*compressed, *reference)
    assert float(compressed[0]) != float(dense[0]) and not np.array_equal(_flat(compressed[1]), _flat(dense[1]))
  for who, d in figures.items():
    print(f"\n{name}, {who}: MaxText's check {'holds' if d['holds'] else 'fails'}; loss relative error "
          f"{d['loss']:.1e}; gradient elements outside rtol 1e-1 {d['outside']:.2%} (largest relative error "
          f"{d['worst']:.2g}); |g - g_ref| / |g_ref| {d['norm']:.1e}")
  assert figures["MaxText"]["holds"] and figures["maxabs:16"]["holds"]
  assert figures["maxabs:8"]["loss"] <= 1e-2 and figures["maxabs:8"]["norm"] <= 1e-1


def _messages(config) -> int:
  """Activation messages MaxText's loop sends per call: one ring per iteration (stage outputs), two with the
  circular storage (its mover too); iterations = microbatches x repeats + forwarding delay x (stages - 1)."""
  delay = 2 if config.pipeline_delay_activation_forwarding else 1
  iterations = config.num_pipeline_microbatches * config.num_pipeline_repeats + delay * (STAGES - 1)
  circular_storage = config.num_pipeline_repeats > 1 and config.num_pipeline_microbatches > STAGES * delay
  return iterations * (2 if circular_storage else 1)


@pytest.mark.parametrize("name", CONFIGS)
def test_stage_permutes_carry_exactly_the_codecs_bytes(name):
  """Compiled with fwd=maxabs:4, bwd=maxabs:8 (and none/none): each way, every iteration's ring of STAGES
  messages moves the codec's wire_bytes of one stage's block [microbatch, length, embed] per message, and the
  other collective-permutes (the state_io stream) move what they move in unpatched MaxText."""
  config, _, pipeline_loss, *_ = _case(name)
  block = (config.micro_batch_size_to_train_on // config.num_pipeline_microbatches, config.max_target_length,
           config.emb_dim)
  unpatched = jaxcomp_maxtext.stage_permute_bytes(_compiled(name, pipeline_loss, None)[0].as_text())
  assert unpatched["fwd"] == unpatched["bwd"] == 0  # no permute under the patch's scope: all are `other`
  pairs = _messages(config) * STAGES
  sent = {}
  for fwd, bwd in (("none", "none"), ("maxabs:4", "maxabs:8")):
    sent[fwd] = jaxcomp_maxtext.stage_permute_bytes(_compiled(name, pipeline_loss, (fwd, bwd))[0].as_text())
    wire = jaxcomp.compressed_link(fwd, bwd).wire_bytes(block, jnp.float32)
    assert (sent[fwd]["fwd"], sent[fwd]["bwd"]) == (pairs * wire[0], pairs * wire[1]), (fwd, bwd)
  assert sum(sent["none"].values()) == unpatched["other"]  # the same permutes as unpatched MaxText's
  assert sent["maxabs:4"]["other"] == sent["none"]["other"] > 0  # the state_io stream, dense
  print(f"\n{name}: {_messages(config)} messages of {block} fp32 each way; bytes per call none/none {sent['none']}, "
        f"maxabs:4/maxabs:8 {sent['maxabs:4']}")


def test_the_patch_is_undone_and_refuses_what_it_cannot_do():
  """After the context MaxText's module sees jax itself again (also after an error inside); stateful specs
  and a nested patch are refused by name."""
  with pytest.raises(ZeroDivisionError), jaxcomp_maxtext.patch_pipeline("maxabs:4", "maxabs:8"):
    assert pipeline.jax is not jax
    raise ZeroDivisionError
  assert pipeline.jax is jax
  with pytest.raises(ValueError, match=r"fwd='ef21\+topk:0.1', bwd='maxabs:8' keep state between steps"):
    with jaxcomp_maxtext.patch_pipeline("ef21+topk:0.1", "maxabs:8"):
      pass
  with pytest.raises(ValueError, match=r"bits must be an integer in 1..16, got 99"):
    with jaxcomp_maxtext.patch_pipeline("maxabs:99", "maxabs:8"):
      pass
  with jaxcomp_maxtext.patch_pipeline(), pytest.raises(RuntimeError, match="do not nest"):
    with jaxcomp_maxtext.patch_pipeline():
      pass
  assert pipeline.jax is jax


def test_maxtext_train_loop_learns_and_sends_fewer_bytes(tmp_path):
  """MaxText's train.main, 4 steps on its synthetic data, tiny decoder in 4 stages, uncompressed and with
  maxabs:4/maxabs:8 and maxabs:8/maxabs:8 (examples/maxtext_train.py, in its own process): every loss finite, the
  last below the first; the stage activations' bytes per step fall by the codec's ratio, the other permutes' not."""
  out = tmp_path / "runs.json"
  env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags(STAGES)}
  done = subprocess.run([sys.executable, "-m", "examples.maxtext_train", "--steps", "4", "--json", str(out)],
                        env=env, capture_output=True, text=True, timeout=900,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  runs = json.loads(out.read_text())
  assert [(run["fwd"], run["bwd"]) for run in runs] == [("none", "none"), ("maxabs:4", "maxabs:8"),
                                                        ("maxabs:8", "maxabs:8")]
  for run in runs:
    assert all(math.isfinite(loss) for loss in run["losses"]) and run["losses"][-1] < run["losses"][0], run
  dense = runs[0]["bytes_per_step"]
  assert dense["fwd"] > 0 and dense["bwd"] > 0  # the patch's permutes are in the program
  for run in runs[1:]:
    assert run["losses"] != runs[0]["losses"]  # the codecs acted
    dense_message = 4 * math.prod(run["message_shape"])  # fp32, as the uncompressed program's permutes carry them
    fwd, bwd = jaxcomp.compressed_link(run["fwd"], run["bwd"]).wire_bytes(tuple(run["message_shape"]), jnp.float32)
    sent = run["bytes_per_step"]
    assert sent["other"] == dense["other"]
    assert sent["fwd"] * dense_message == dense["fwd"] * fwd and sent["bwd"] * dense_message == dense["bwd"] * bwd
