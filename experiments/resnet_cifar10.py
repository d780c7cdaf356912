"""ResNet18 on CIFAR-10 in 4 pipeline stages: Rudakov et al. Tables 1-4 as presets.

    python -m experiments.resnet_cifar10 --preset fw4-bw8
    python -m experiments.resnet_cifar10 --preset baseline --epochs 20            # then:
    python -m experiments.resnet_cifar10 --preset ef21-top10-base20 --init-from runs/resnet_cifar10/baseline

Recipes (`--recipe`): `paper` (the default): batch 100, SGD lr 0.01 momentum 0.9 weight
decay 5e-4, cosine over 200 epochs, 100 epochs; `tiny`: width 16, 2 epochs, cosine over 2.
Data: CIFAR-10 from --data-dir (cifar-10-batches-py or a tfds cifar10 there; anything else
is an error) or tensorflow-datasets' default folder; without either, a generated stand-in
that every output labels NOT CIFAR-10.
"""
import dataclasses

import numpy as np
import optax

from experiments import checks, cli, config, paper
from jaxcomp import losses
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.data import batching, cifar10
from jaxcomp.models import resnet
from jaxcomp.pipeline import Pipeline
from jaxcomp.runtime import train

PAPER = dict(fwd="none", bwd="none", epochs=100, batch_size=100, microbatches=1, stages=4, lr=0.01, seed=0,
             momentum=0.9, weight_decay=5e-4, cosine_epochs=200, width=64, data_source="auto", data_dir=None)
RECIPES = {"paper": PAPER, "tiny": {**PAPER, "width": 16, "epochs": 2, "cosine_epochs": 2}}


def _presets():
  presets = {"baseline": {}}
  for a in (4, 2):
    for b in (8, 6, 4, 2):
      if (a, b) != (2, 2):
        presets[f"fw{a}-bw{b}"] = dict(fwd=f"quant:{a}", bwd=f"quant:{b}")
  for k in (50, 30, 20, 10, 5, 2):
    presets[f"top{k}"] = dict(fwd=f"topk:{k / 100}", bwd=f"topk:{k / 100}")
  presets["ef-top10-base20"] = dict(fwd="ef+topk:0.1", bwd="ef+topk:0.1", init_epoch=20)
  presets["efmixed-top10-base20"] = dict(fwd="efmixed+topk:0.1", bwd="efmixed+topk:0.1", init_epoch=20)
  presets["ef21-top5"] = dict(fwd="ef21+topk:0.05", bwd="ef21+topk:0.05")
  presets["ef21-top10"] = dict(fwd="ef21+topk:0.1", bwd="ef21+topk:0.1")
  presets["ef21-top10-base20"] = dict(fwd="ef21+topk:0.1", bwd="ef21+topk:0.1", init_epoch=20)
  for k in (50, 30, 20, 10):  # buffers fill during the first epoch after the warm start
    presets[f"aqsgd-top{k}-base10"] = dict(fwd=f"aqsgd+topk:{k / 100}", bwd=f"topk:{k / 100}", init_epoch=10,
                                           warmup_epochs=11)
  return presets


PRESETS = _presets()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """ResNet18 / CIFAR-10's own settings (`config.RunConfig.options`; the recipes set them)."""
  width: int  # channels of layer1 (64 = ResNet18)
  momentum: float
  weight_decay: float
  cosine_epochs: int  # the learning rate's cosine decay spans this many epochs
  data_source: str
  data_dir: str | None = None


def _subset(split, n):
  return split if n is None else {k: v[:n] for k, v in split.items()}


CIFAR10_TRAIN = 50_000


def assemble(run: config.RunConfig, num_train: int):
  """(Pipeline, optimizer) of the run for `num_train` training images (AQ-SGD tables, lr schedule)."""
  own, stages = run.options, run.executor.model_stages
  bs, shards = run.training.batch_size, run.executor.data_parallel
  schedule = optax.cosine_decay_schedule(run.training.lr, own.cosine_epochs * batching.num_batches(num_train, bs, shards))
  optimizer = optax.chain(optax.add_decayed_weights(own.weight_decay), optax.sgd(schedule, momentum=own.momentum))
  if stages not in resnet.STAGE_COUNTS:
    chunks = f" x {stages // run.executor.stages} chunks per device (--schedule {run.executor.schedule})" \
        if stages > run.executor.stages else ""
    raise ValueError(f"--stages {run.executor.stages}{chunks}: ResNet18 splits into {list(resnet.STAGE_COUNTS)} "
                     "stages; pass one of those")
  given = [flag for flag, value in (("--untie-embeddings", run.compression.untie_embeddings),
                                    ("--tied-compression", run.compression.tied_compression)) if value]
  if given:
    raise ValueError(f"{' and '.join(given)}: ResNet18 has no tied parameters; drop {' and '.join(given)}")
  boundary = parse_boundary(run.compression.fwd, run.compression.bwd, num_examples=num_train)
  model = resnet.resnet18_stages(resnet.ResNet18Config(width=own.width), stages)
  return Pipeline(model, boundary, losses.classification, "image", run.executor.microbatches), optimizer


def build(run: config.RunConfig):
  data = cifar10.load(run.options.data_source, run.options.data_dir)
  train_split = _subset(data.train, run.data.train_examples)
  test_split = _subset(data.test, run.data.eval_examples)
  data = cifar10.ImageData(data.name, train_split, test_split)
  bs, shards, seed = run.training.batch_size, run.executor.data_parallel, run.training.seed
  checks.check_batch_size(bs, len(train_split["label"]), len(test_split["label"]))
  pipe, optimizer = assemble(run, len(train_split["label"]))
  return pipe, optimizer, train.Data(
      train_batches=lambda epoch: cifar10.train_batches(data, bs, seed, epoch, shards),
      steps_per_epoch=batching.num_batches(len(train_split["label"]), bs, shards),
      eval_batches=lambda: cifar10.eval_batches(data, bs),
      example_batch=next(cifar10.train_batches(data, bs, seed, 0, shards)), name=data.name), None


def abstract(run: config.RunConfig):
  """(Pipeline, optimizer, batch shapes, what was assumed) of the run without reading images (--compile-for):
  --train-examples training images, else CIFAR-10's 50,000."""
  num_train = run.data.train_examples or CIFAR10_TRAIN
  assumed = "" if run.data.train_examples else f"{CIFAR10_TRAIN} training images (CIFAR-10's training set)"
  pipe, optimizer = assemble(run, num_train)
  bs, shards = run.training.batch_size, run.executor.data_parallel
  split = {"image": np.zeros((bs, 32, 32, 3), np.uint8), "label": np.zeros((bs,), np.int32)}
  batch = next(cifar10.train_batches(cifar10.ImageData("", split, split), bs, run.training.seed, 0, shards))
  return pipe, optimizer, batch, assumed


FLAGS = {
    "width": ("training", "channels of layer1 (64 = ResNet18)", dict(type=int)),
    "data_source": ("data", "where CIFAR-10 comes from", dict(choices=cifar10.SOURCES)),
    "data_dir": ("data", "folder with cifar-10-batches-py, or tfds data_dir", {}),
}


EXPERIMENT = config.Experiment("resnet_cifar10", RECIPES, "paper", PRESETS, build, abstract, Options, FLAGS,
                               paper.resnet_row)

if __name__ == "__main__":
  cli.main(EXPERIMENT)
