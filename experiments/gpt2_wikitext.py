"""GPT-2 trained on WikiText-2 in 4 pipeline stages: Rudakov Table 5 and AQ-SGD rows as presets.

    python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4        # offline default (tiny recipe)
    python -m experiments.gpt2_wikitext --recipe paper --preset top10-reuse --pretrained gpt2 \\
        --data-dir WIKITEXT2_RAW_DIR --tokenizer-dir GPT2_DIR           # the paper's setting

Recipes (`--recipe`; explicit flags override them): `paper` is the HF Trainer's (4 epochs,
batch 8, AdamW lr 5e-5 linearly decayed to 0, weight decay 0, gradient clipping at norm 1.0,
blocks of 1024 GPT-2 BPE tokens, GPT-2 small cut after blocks 2, 5, 8); `tiny` (the default)
trains a tiny GPT-2 from scratch on byte tokens, blocks of 128, lr 1e-3, 2 epochs. Text:
`--train-file/--valid-file` (any names, raw or tokenized WikiText), `--data-dir` (wiki.train
and wiki.valid .raw or .tokens), else the WikiText-2 validation text shipped with jaxcomp,
split by article 90/10 and labelled as such in every output.
"""
import dataclasses
import json
import pathlib

import jax
import numpy as np
import optax

from experiments import common, paper
from jaxcomp import losses
from jaxcomp.compress import bottleneck
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.data import batching, text
from jaxcomp.models import gpt2, gpt2_weights
from jaxcomp.pipeline import Pipeline
from jaxcomp.runtime import train

PAPER = dict(fwd="none", bwd="none", epochs=4, batch_size=8, microbatches=1, stages=4, lr=5e-5, seed=0,
             weight_decay=0.0, grad_clip=1.0, model="small", pretrained=None, block_size=1024, tokenizer="gpt2")
RECIPES = {"paper": PAPER, "tiny": {**PAPER, "model": "tiny", "block_size": 128, "lr": 1e-3, "epochs": 2,
                                    "tokenizer": "bytes"}}


def _presets():
  presets = {"baseline": {}}
  for k in (50, 30, 20, 10):
    presets[f"top{k}-reuse"] = dict(fwd=f"topk:{k / 100}", bwd="reuse")
  presets["top10-separate"] = dict(fwd="topk:0.1", bwd="topk:0.1")
  for a, b in ((2, 4), (3, 6), (4, 8)):
    presets[f"direct-fw{a}-bw{b}"] = dict(fwd=f"maxabs:{a}:stoch", bwd=f"maxabs:{b}:stoch")
    presets[f"aqsgd-fw{a}-bw{b}"] = dict(fwd=f"aqsgd+maxabs:{a}:stoch", bwd=f"maxabs:{b}:stoch", warmup_epochs=1)
    # the same dense first epoch without AQ-SGD's buffer: separates the warm-up from the buffer
    presets[f"direct-fw{a}-bw{b}-warm1"] = dict(fwd=f"maxabs:{a}:stoch", bwd=f"maxabs:{b}:stoch", warmup_epochs=1)
  return presets


PRESETS = _presets()


def corpus_for(config) -> text.Corpus:
  """--train-file [--valid-file], else --data-dir, else the shipped WikiText-2 validation text."""
  if config.get("valid_file") and not config.get("train_file"):
    raise ValueError("--valid-file needs --train-file too")
  if config.get("train_file"):
    if config.get("data_dir"):
      raise ValueError("give either --data-dir or --train-file/--valid-file, not both")
    return text.files_corpus(config["train_file"], config.get("valid_file"))
  if config.get("data_dir"):
    return text.data_dir_corpus(config["data_dir"])
  return text.shipped_corpus()


def tokenizer_for(config):
  """--tokenizer; GPT-2's files from --tokenizer-dir, else from a local --pretrained folder."""
  if config["pretrained"] and config["tokenizer"] != "gpt2":
    raise ValueError(f"--pretrained {config['pretrained']} reads GPT-2 BPE tokens, not {config['tokenizer']}: "
                     "add --tokenizer gpt2 --tokenizer-dir DIR (or --recipe paper)")
  directory = config.get("tokenizer_dir")
  if directory is None and config["pretrained"] and (pathlib.Path(config["pretrained"]) / "vocab.json").is_file():
    directory = config["pretrained"]
  if config["tokenizer"] == "gpt2" and directory is None:
    raise ValueError("--tokenizer gpt2 needs --tokenizer-dir DIR with GPT-2's vocab.json and merges.txt "
                     "(or use --tokenizer bytes)")
  return text.tokenizer(config["tokenizer"], directory)


# sizes AQ-SGD's per-example tables in --compile-for when --train-examples is not given: WikiText-2's
# raw training text is about 2.4 million GPT-2 tokens (an assumption stated wherever it is used)
WIKITEXT2_TRAIN_TOKENS = 2_400_000
HUB_SIZES = {"gpt2": "small", "gpt2-medium": "medium", "gpt2-large": "large", "gpt2-xl": "xl"}


def model_config(config, vocab_size: int) -> gpt2.GPT2Config:
  """--model's GPT-2 (random initialisation) with the tokenizer's vocabulary."""
  base = getattr(gpt2.GPT2Config, config["model"])()
  return gpt2.GPT2Config(**{**base.__dict__, "vocab_size": vocab_size,
                            "n_positions": max(base.n_positions, config["block_size"])})


def outliers(text: str, width: int) -> dict:
  """--outliers N:SCALE[:MASSIVE] as GPT2Config fields (outlier_channels, outlier_scale, massive)."""
  parts = text.split(":")
  try:
    if len(parts) not in (2, 3):
      raise ValueError
    fields = {"outlier_channels": int(parts[0]), "outlier_scale": float(parts[1]),
              "massive": float(parts[2]) if len(parts) == 3 else 0.0}
  except ValueError:
    raise ValueError("expected N:SCALE[:MASSIVE], e.g. 4:64:1024 (4 channels times 64, 1024 added at the first "
                     "token in two of them)") from None
  if not 1 <= fields["outlier_channels"] <= width:
    raise ValueError(f"N must be in 1..{width} (the model's width)")
  return fields


def assemble(config, cfg: gpt2.GPT2Config, num_train: int):
  """(Pipeline, optimizer) of the run for `num_train` training blocks (AQ-SGD tables, lr schedule)."""
  if config.get("outliers"):
    try:
      cfg = dataclasses.replace(cfg, **outliers(config["outliers"], cfg.n_embd))
    except ValueError as err:
      raise ValueError(f"--outliers {config['outliers']!r}: {err}") from None
  if config.get("dropout") is not None:
    if not 0.0 <= config["dropout"] < 1.0:
      raise ValueError(f"--dropout must be in [0, 1), got {config['dropout']}")
    cfg = dataclasses.replace(cfg, dropout=config["dropout"])
  if not 1 <= config["stages"] <= cfg.n_layer:
    raise ValueError(f"--stages {config['stages']}: this GPT-2 has {cfg.n_layer} blocks, so it splits into "
                     f"1..{cfg.n_layer} stages; pass one of those (or a larger --model)")
  s, bs, shards = config["stages"], config["batch_size"], config["data_parallel"]
  steps = batching.num_batches(num_train, bs, shards) * config["epochs"]
  optimizer = optax.adamw(optax.linear_schedule(config["lr"], 0.0, steps), weight_decay=config["weight_decay"])
  boundary = parse_boundary(config["fwd"], config["bwd"], num_examples=num_train)
  stages, tied = gpt2.gpt2_stages(cfg, s), gpt2.gpt2_tied(s)
  if config.get("bottleneck"):
    try:
      learned = bottleneck.parse(config["bottleneck"])
      stages, tied = bottleneck.wrap(stages, learned, cfg.n_embd), tied + bottleneck.tied(learned, s)
    except ValueError as err:
      raise ValueError(f"--bottleneck {config['bottleneck']}: {err}") from None
  pipe = Pipeline(stages, boundary, losses.language_model, "tokens", config["microbatches"], tied=tied,
                  grad_clip_norm=config["grad_clip"])
  return pipe, optimizer


def build(config):
  data = text.load(corpus_for(config), tokenizer_for(config), config["block_size"], min_blocks=config["batch_size"])
  train_blocks = data.train[: config.get("train_examples")]
  eval_blocks = data.validation[: config.get("eval_examples")]
  common.check_batch_size(config["batch_size"], len(train_blocks), len(eval_blocks))
  data = text.TextData(data.name, train_blocks, eval_blocks, data.vocab_size)
  if config["pretrained"]:
    cfg, params = gpt2_weights.from_pretrained(config["pretrained"], config["stages"])
    if config.get("bottleneck"):  # pretrained weights kept; P and Q start as in a fresh run
      params = bottleneck.insert_into(params, bottleneck.parse(config["bottleneck"]), cfg.n_embd,
                                      jax.random.key(config["seed"]))
  else:
    cfg, params = model_config(config, data.vocab_size), None
  pipe, optimizer = assemble(config, cfg, len(train_blocks))
  bs, shards, seed = config["batch_size"], config["data_parallel"], config["seed"]
  return pipe, optimizer, train.Data(
      train_batches=lambda epoch: text.train_batches(data, bs, seed, epoch, shards),
      steps_per_epoch=batching.num_batches(len(train_blocks), bs, shards),
      eval_batches=lambda: text.eval_batches(data, bs), example_batch=next(text.train_batches(data, bs, seed, 0, shards)),
      name=data.name, eval_summary=losses.with_perplexity), params


def abstract(config):
  """(Pipeline, optimizer, batch shapes, what was assumed) of the run, reading no text and no weights
  (--compile-for): the vocabulary of --tokenizer, the size of --model or of --pretrained (its config.json,
  or a hub name's size), and --train-examples training blocks, else WikiText-2's (assumed) size."""
  vocab = text.ByteTokenizer().vocab_size if config["tokenizer"] == "bytes" else gpt2.GPT2Config().vocab_size
  pretrained = config["pretrained"]
  if pretrained and pathlib.Path(pretrained, "config.json").is_file():
    cfg = gpt2_weights.config_from_hf(json.loads(pathlib.Path(pretrained, "config.json").read_text()))
  elif pretrained:
    if pretrained not in HUB_SIZES:
      raise ValueError(f"--pretrained {pretrained}: --compile-for reads a local folder's config.json or a hub name "
                       f"it knows ({', '.join(HUB_SIZES)}); use --model instead")
    cfg = model_config({**config, "model": HUB_SIZES[pretrained]}, vocab)
  else:
    cfg = model_config(config, vocab)
  num_train, assumed = config.get("train_examples"), ""
  if num_train is None:
    num_train = WIKITEXT2_TRAIN_TOKENS // config["block_size"]
    assumed = (f"{num_train} training blocks (assumed: WikiText-2's ~{WIKITEXT2_TRAIN_TOKENS:,} training tokens / "
               f"{config['block_size']}; --train-examples sets it)")
  pipe, optimizer = assemble(config, cfg, num_train)
  bs, shards, block = config["batch_size"], config["data_parallel"], config["block_size"]
  placeholder = text.TextData("", np.zeros((bs, block), np.int32), np.zeros((bs, block), np.int32), vocab)
  batch = next(text.train_batches(placeholder, bs, config["seed"], 0, shards))
  return pipe, optimizer, batch, assumed


FLAGS = {
    "bottleneck": ("compression", "learned rank-R projection at every boundary, proj:R or subspace:R (sends z = x P, "
                   "R wide; --fwd/--bwd compress z and its gradient)", {}),
    "model": ("training", "GPT-2 size", dict(choices=["tiny", "small", "medium", "large", "xl"])),
    "outliers": ("training", "N:SCALE[:MASSIVE]: what crosses the stage boundaries carries N residual channels "
                 "times SCALE and MASSIVE added at the first token in two of them, as pretrained transformers' "
                 "residual streams do (same model function; jaxcomp.models.gpt2), e.g. 4:64:1024", {}),
    "pretrained": ("training", "HF GPT-2 directory or hub name to fine-tune from", {}),
    "dropout": ("training", "dropout rate (default: the model's, 0.1)", dict(type=float)),
    "tokenizer": ("data", "byte tokens or GPT-2 BPE (--tokenizer-dir)", dict(choices=text.TOKENIZERS)),
    "tokenizer_dir": ("data", "folder with GPT-2's vocab.json and merges.txt", {}),
    "train_file": ("data", "training text (raw or tokenized WikiText, any name)", {}),
    "valid_file": ("data", "evaluation text (default: the last 10%% of --train-file's articles)", {}),
    "data_dir": ("data", "folder with wiki.{train,valid}.raw or wiki.{train,valid}.tokens (default: the "
                 "WikiText-2 validation text shipped with jaxcomp)", {}),
    "block_size": ("data", "tokens per example", dict(type=int)),
}


EXPERIMENT = common.Experiment("gpt2_wikitext", RECIPES, "tiny", PRESETS, build, abstract, FLAGS, paper.gpt2_row)

if __name__ == "__main__":
  common.main(EXPERIMENT)
