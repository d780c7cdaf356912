"""GPT-2 trained on WikiText-2 in 4 pipeline stages: Rudakov Table 5 and AQ-SGD rows as presets.

    python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4        # offline default (tiny recipe)
    python -m experiments.gpt2_wikitext --recipe paper --preset top10-reuse --pretrained gpt2 \\
        --data wikitext2-raw                                            # the paper's setting (downloads)

Recipes (`--recipe`; explicit flags override them): `paper` is the HF Trainer's (4 epochs,
batch 8, AdamW lr 5e-5 linearly decayed to 0, weight decay 0, gradient clipping at norm 1.0,
blocks of 1024 GPT-2 BPE tokens, GPT-2 small cut after blocks 2, 5, 8); `tiny` (the default)
trains a tiny GPT-2 from scratch on byte tokens, blocks of 128, lr 1e-3, 2 epochs; `pretrain-cpu` and
`finetune-cpu` are the papers' regime (pretrain, then fine-tune on another text) at CPU scale (`experiments.finetune`). `protocol` is Protocol
NanoGPT's benchmark (its dense record's recipe: `--model protocol-203m`, Muon + AdamW, 512 x 1024 tokens a step,
1F1B over 8 stages of 64 microbatches, 3,000 steps, eval every 25 steps, target eval loss 3.276);
`protocol-cpu` the same architecture and optimizer at 2-CPU-core scale (`protocol-tiny`, byte tokens). Text:
`--data wikitext2-raw` (the papers' WikiText-2 raw v1, downloaded through Hugging Face datasets, `.[data]`),
`--train-file/--valid-file` (any names, raw or tokenized WikiText), `--data-dir` (wiki.train
and wiki.valid .raw or .tokens), else the WikiText-2 validation text shipped with jaxcomp,
split by article 90/10 and labelled as such in every output (`--text`: another shipped text).
"""
import dataclasses
import json
import math
import pathlib

import jax
import numpy as np
import optax

from experiments import checks, cli, config, paper
from jaxcomp import losses, methods
from jaxcomp.compress import bottleneck
from jaxcomp.compress.spec import parse_boundary, parse_scheme
from jaxcomp.data import batching, hub_text, text
from jaxcomp.models import gpt2, gpt2_weights, protocol_gpt, registry
from jaxcomp.pipeline import Pipeline
from jaxcomp.runtime import train
from jaxcomp.runtime.pretrained import checkpoint_params

PAPER = dict(fwd="none", bwd="none", epochs=4, batch_size=8, microbatches=1, stages=4, lr=5e-5, seed=0,
             weight_decay=0.0, grad_clip=1.0, model="small", pretrained=None, block_size=1024, tokenizer="gpt2")
# Protocol NanoGPT's optimizer settings where a flag leaves them unset (train_gpt.py, its dense record)
MUON_DEFAULTS = dict(embed_lr=0.7, head_lr=0.004, scalar_lr=0.015, muon_weight_decay=0.05)
MUON_ADAMW = dict(b1=0.8, b2=0.95, eps=1e-10)  # its AdamW beside Muon
MUON = dict(ns_coeffs=(2.0, -1.5, 0.5), ns_steps=12, beta=0.95, eps=1e-7, nesterov=True)  # its Newton-Schulz and momentum
# Protocol NanoGPT's dense record (PluralisResearch/ProtocolNanoGPT, train_gpt.py, records/20260917_vanilla_baseline):
# 512 x 1024 tokens a step in 64 microbatches of 8 (ReparamSSN's record: 32 of 16, `--microbatches 32`) over 8 stages
# on 1F1B; Muon lr 0.025 (wd 0.05) for the blocks' matrices, AdamW (0.8, 0.95, eps 1e-10, wd 0.001) at 0.7 for the
# embedding, 0.004 for the head, 0.015 for the vectors; a schedule of 3,000 steps, constant for 30%, then linearly to
# 0; validated every 25 steps against 3.276. The benchmark streams FineWeb (GPT-2 BPE); here --train-file or
# --data-dir and --tokenizer-dir give the text. `epochs` only bounds the run: its 3,000 steps end it.
PROTOCOL = dict(PAPER, model="protocol-203m", optimizer="muon", lr=0.025, **MUON_DEFAULTS, weight_decay=0.001,
                cooldown=0.7, lr_steps=3000, steps=3000, epochs=3000, grad_clip=None, batch_size=512,
                microbatches=paper.PROTOCOL_RECORDS["dense-bf16"]["microbatches"], stages=8, executor="sharded",
                schedule="1f1b", eval_every=25, target_loss=paper.PROTOCOL_TARGET_LOSS)
# The same at 2-CPU-core scale: `protocol-tiny` (4 blocks of width 128, one per stage on 4 stages) on the shipped
# text's byte tokens, blocks of 128, 16 a step in 4 microbatches, the benchmark's optimizer settings over 200 steps,
# evaluated every 25 on 256 blocks (docs/results/time_to_target.md: the methods' steps to a target on it)
PROTOCOL_CPU = dict({k: v for k, v in PROTOCOL.items() if k != "target_loss"}, model="protocol-tiny",
                    tokenizer="bytes", block_size=128, batch_size=16, microbatches=4, stages=4, executor="simulate",
                    schedule="gpipe", lr_steps=200, steps=200, epochs=1, eval_examples=256)
TINY = {**PAPER, "model": "tiny", "block_size": 128, "lr": 1e-3, "epochs": 2, "tokenizer": "bytes"}
# The papers' regime at 2-CPU-core scale (experiments.finetune): a tiny GPT-2 trained here with fp32 boundaries on
# one shipped text (`pretrain-cpu`: the King James Bible, 1,500 steps of 16 x 128 bytes, lr 1e-3 linearly to 0), then
# fine-tuned on another (`finetune-cpu`: tiny Shakespeare's first 256 training blocks for 8 epochs of 32 steps at
# batch 8, AdamW lr 3e-4 linearly to 0, as the paper recipe's, evaluated every 16 steps on 128 held-out blocks);
# --pretrained names the pretrained run's folder
PRETRAIN_CPU = {**TINY, "text": "kjv", "epochs": 1, "steps": 1500, "lr_steps": 1500, "batch_size": 16,
                "eval_examples": 256}
FINETUNE_CPU = {**TINY, "text": "shakespeare", "epochs": 8, "lr": 3e-4, "train_examples": 256, "eval_examples": 128,
                "eval_every": 16}
RECIPES = {"paper": PAPER, "tiny": TINY, "protocol": PROTOCOL, "protocol-cpu": PROTOCOL_CPU,
           "pretrain-cpu": PRETRAIN_CPU, "finetune-cpu": FINETUNE_CPU}


PAPER_ROWS = ("top50-reuse", "top30-reuse", "top20-reuse", "top10-reuse", "top10-separate", "direct-fw2-bw4",
              "aqsgd-fw2-bw4", "direct-fw3-bw6", "aqsgd-fw3-bw6", "direct-fw4-bw8", "aqsgd-fw4-bw8")


def _presets():
  """The papers' GPT-2 rows as presets, each a method of the registry (`baseline`: the dense run), and each AQ-SGD
  row's direct twin with the same dense first epoch (`direct-fwA-bwB-warm1`: separates the warm-up from the
  buffer)."""
  given = lambda name: {k: v for k, v in methods.get(name).run_settings().items() if v}  # no bottleneck, no warm-up
  presets = {"baseline": given(methods.DENSE), **{name: given(name) for name in PAPER_ROWS}}
  for name in [n for n in PAPER_ROWS if n.startswith("aqsgd-")]:
    row = presets[name]
    presets[name.replace("aqsgd-", "direct-") + "-warm1"] = {**row, "fwd": row["fwd"].removeprefix("aqsgd+")}
  return presets


PRESETS = _presets()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """GPT-2 / WikiText-2's own settings (`config.RunConfig.options`; the recipes set the first six)."""
  model: str  # GPT-2 size (random initialisation)
  pretrained: str | None  # a run trained here (its folder), or an HF GPT-2 folder or hub name, to fine-tune from
  weight_decay: float
  grad_clip: float | None  # global gradient-norm clipping
  block_size: int  # tokens per example
  tokenizer: str
  dropout: float | None = None  # None: the model's
  outliers: str | None = None  # N:SCALE[:MASSIVE]: outlier channels across the boundaries (`outliers`)
  optimizer: str = "adamw"  # adamw: AdamW for every parameter; muon: Muon for the blocks' matrices (`optimizer_for`)
  cooldown: float = 1.0  # the share of the lr schedule's steps, at its end, over which lr falls linearly to 0
  lr_steps: int | None = None  # the lr schedule's length in steps (None: every epoch's steps)
  embed_lr: float | None = None  # --optimizer muon: AdamW's lr for the embedding (None: Protocol NanoGPT's) ...
  head_lr: float | None = None  # ... for the head ...
  scalar_lr: float | None = None  # ... and for the vectors (biases, gains)
  muon_weight_decay: float | None = None  # --optimizer muon: Muon's decoupled weight decay (None: Protocol NanoGPT's)
  tokenizer_dir: str | None = None
  train_file: str | None = None
  valid_file: str | None = None
  data_dir: str | None = None
  data: str | None = None  # a text downloaded from the Hugging Face hub (hub_text.HUB_TEXTS), e.g. wikitext2-raw
  text: str = "wikitext2"  # the shipped text without --train-file / --data-dir (text.SHIPPED_TEXTS)
  model_width: int | None = None  # the width of a SCALABLE_MODELS model (None: its own, 64 or 128)


def corpus_for(own: Options) -> text.Corpus:
  """--data (downloaded), else --train-file [--valid-file], else --data-dir, else the shipped --text (default the
  WikiText-2 validation text)."""
  if own.data:
    given = [f"--{k.replace('_', '-')}" for k in ("train_file", "valid_file", "data_dir") if getattr(own, k)]
    given += [f"--text {own.text}"] if own.text != "wikitext2" else []
    if given:
      raise ValueError(f"--data {own.data} downloads its text and {' and '.join(given)} names another: choose one")
    return hub_text.hub_corpus(own.data)
  if own.valid_file and not own.train_file:
    raise ValueError("--valid-file needs --train-file too")
  if (own.train_file or own.data_dir) and own.text != "wikitext2":
    raise ValueError(f"--text {own.text} is a shipped text; --train-file and --data-dir give your own: choose one")
  if own.train_file:
    if own.data_dir:
      raise ValueError("give either --data-dir or --train-file/--valid-file, not both")
    return text.files_corpus(own.train_file, own.valid_file)
  if own.data_dir:
    return text.data_dir_corpus(own.data_dir)
  return text.shipped_corpus(own.text)


def run_folder(own: Options) -> pathlib.Path | None:
  """--pretrained as a run trained here (a folder with a `ckpt` folder: fine-tuned from its newest checkpoint),
  else None (a GPT-2 of Hugging Face's, a folder or a hub name, or no --pretrained)."""
  if own.pretrained and pathlib.Path(own.pretrained, "ckpt").is_dir():
    return pathlib.Path(own.pretrained)
  return None


def hub_model(own: Options) -> pathlib.Path | None:
  """--pretrained as a Hugging Face GPT-2's local folder (a hub name downloaded once, `gpt2_weights.snapshot`:
  weights, vocab.json and merges.txt), the settings it needs checked first; None without one (no --pretrained, or a
  run trained here)."""
  if not own.pretrained or run_folder(own) is not None:
    return None
  if own.model in PROTOCOL_MODELS:
    raise ValueError(f"--pretrained {own.pretrained} loads Hugging Face GPT-2 weights (no {own.pretrained}/ckpt, so "
                     f"not a run trained here); --model {own.model} starts from a run of its own: pass its folder")
  if own.tokenizer != "gpt2":
    raise ValueError(f"--pretrained {own.pretrained} reads GPT-2 BPE tokens, not {own.tokenizer}: "
                     "add --tokenizer gpt2 --tokenizer-dir DIR (or --recipe paper)")
  return gpt2_weights.snapshot(own.pretrained)


def tokenizer_for(own: Options, hub: pathlib.Path | None = None):
  """--tokenizer; GPT-2's files from --tokenizer-dir, else from `hub`, the --pretrained GPT-2's folder (`hub_model`)."""
  directory = own.tokenizer_dir
  if directory is None and hub is not None:
    directory = hub
    if not (directory / "vocab.json").is_file():
      raise ValueError(f"--pretrained {own.pretrained}: no vocab.json and merges.txt in {directory}; add them (they "
                       "are in huggingface.co/gpt2) or pass --tokenizer-dir DIR")
  if own.tokenizer == "gpt2" and directory is None:
    raise ValueError("--tokenizer gpt2 needs GPT-2's vocab.json and merges.txt: --pretrained gpt2 downloads them "
                     "with the weights, or pass --tokenizer-dir DIR (huggingface.co/gpt2 has both files); "
                     "--tokenizer bytes is for a model trained from scratch")
  return text.tokenizer(own.tokenizer, directory)


# sizes AQ-SGD's per-example tables in --compile-for when --train-examples is not given: WikiText-2's
# raw training text is about 2.4 million GPT-2 tokens (an assumption stated wherever it is used)
WIKITEXT2_TRAIN_TOKENS = 2_400_000
HUB_SIZES = {"gpt2": "small", "gpt2-medium": "medium", "gpt2-large": "large", "gpt2-xl": "xl"}


PROTOCOL_MODELS = {"protocol-203m": protocol_gpt.ProtocolConfig.b203m, "protocol-tiny": protocol_gpt.ProtocolConfig.tiny}
SCALABLE_MODELS = ("tiny", "protocol-tiny")  # --model-width sets their width (depth and heads kept)


def model_config(own: Options, vocab_size: int, size: str | None = None):
  """--model's GPT-2 (or `size`'s; random initialisation) with the tokenizer's vocabulary, or its Protocol NanoGPT
  model (`protocol_gpt.ProtocolConfig`: protocol-203m keeps the benchmark's 50,304 tokens, which must hold the
  tokenizer's; protocol-tiny takes the tokenizer's)."""
  if own.model_width is not None and own.model not in SCALABLE_MODELS:
    raise ValueError(f"--model-width scales {' and '.join(SCALABLE_MODELS)}; --model {own.model} has its own width")
  if own.model in PROTOCOL_MODELS:
    base = PROTOCOL_MODELS[own.model]()
    if own.model == "protocol-tiny":
      return dataclasses.replace(base, vocab_size=vocab_size, n_embd=own.model_width or base.n_embd)
    if vocab_size > base.vocab_size:
      raise ValueError(f"--model {own.model} has the benchmark's {base.vocab_size:,}-token vocabulary; the tokenizer "
                       f"has {vocab_size:,}: use --tokenizer gpt2 or --model protocol-tiny")
    return base
  base = getattr(gpt2.GPT2Config, size or own.model)()
  width = own.model_width if size is None and own.model_width else base.n_embd
  if width % base.n_head:
    raise ValueError(f"--model-width {width}: GPT-2 {own.model} has {base.n_head} heads, so its width is a multiple of "
                     f"{base.n_head}")
  return gpt2.GPT2Config(**{**base.__dict__, "vocab_size": vocab_size, "n_embd": width,
                            "n_positions": max(base.n_positions, own.block_size)})


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


def lr_schedule(run: config.RunConfig, lr: float, steps: int) -> optax.Schedule:
  """`lr` for the first 1 - --cooldown of the schedule's `steps`, then linearly to 0 at `steps` (--cooldown 1:
  linearly from the start; Protocol NanoGPT's stable-then-decay with 0.7)."""
  decay = round(run.options.cooldown * steps)
  return optax.linear_schedule(lr, 0.0, decay, transition_begin=steps - decay)


def optimizer_for(run: config.RunConfig, steps: int) -> optax.GradientTransformation:
  """The run's optimizer for an lr schedule of `steps` (`lr_schedule`). --optimizer adamw: AdamW at --lr
  (--weight-decay) on every parameter. --optimizer muon (protocol models): `optax.contrib.muon` at --lr on the blocks'
  matrices (each [in, out] of the stacked [blocks, in, out] its own matrix), AdamW on the embedding, the head and
  the vectors at --embed-lr, --head-lr and --scalar-lr (`protocol_gpt.param_groups`), each on the same schedule."""
  own, lr = run.options, run.training.lr
  if own.optimizer == "adamw":
    return optax.adamw(lr_schedule(run, lr, steps), weight_decay=own.weight_decay)
  if own.model not in PROTOCOL_MODELS:
    raise ValueError(f"--optimizer muon splits a Protocol NanoGPT model's parameters (blocks' matrices, embedding, "
                     f"head, vectors); --model {own.model} is GPT-2: use --model protocol-tiny or protocol-203m")
  hyper = {k: MUON_DEFAULTS[k] if getattr(own, k) is None else getattr(own, k) for k in MUON_DEFAULTS}
  for k, v in hyper.items():
    if not (math.isfinite(v) and v >= 0):
      raise ValueError(f"--{k.replace('_', '-')} must be a finite number >= 0, got {v}")
  adamw = lambda group_lr: optax.adamw(lr_schedule(run, group_lr, steps), weight_decay=own.weight_decay, **MUON_ADAMW)
  matrices = optax.contrib.muon(lr_schedule(run, lr, steps), weight_decay=hyper["muon_weight_decay"],
                                muon_weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(1, 2), **MUON)
  return optax.partition({"matrix": matrices, "embedding": adamw(hyper["embed_lr"]), "head": adamw(hyper["head_lr"]),
                          "vector": adamw(hyper["scalar_lr"])}, protocol_gpt.param_groups)


def assemble(run: config.RunConfig, cfg, num_train: int):
  """(Pipeline, optimizer) of the run for `num_train` training blocks (AQ-SGD tables, lr schedule)."""
  own, learned_spec = run.options, run.compression.bottleneck
  protocol = isinstance(cfg, protocol_gpt.ProtocolConfig)
  if protocol and (own.outliers or own.dropout is not None):
    raise ValueError(f"--outliers and --dropout change GPT-2 models; --model {own.model} has neither")
  if own.optimizer not in ("adamw", "muon"):
    raise ValueError(f"--optimizer {own.optimizer!r}: choose adamw or muon")
  if not 0.0 < own.cooldown <= 1.0:
    raise ValueError(f"--cooldown must be in (0, 1] (the share of the schedule that decays), got {own.cooldown}")
  if not (math.isfinite(own.weight_decay) and own.weight_decay >= 0):
    raise ValueError(f"--weight-decay must be a finite number >= 0, got {own.weight_decay}")
  if own.outliers:
    try:
      cfg = dataclasses.replace(cfg, **outliers(own.outliers, cfg.n_embd))
    except ValueError as err:
      raise ValueError(f"--outliers {own.outliers!r}: {err}") from None
  if own.dropout is not None:
    if not 0.0 <= own.dropout < 1.0:
      raise ValueError(f"--dropout must be in [0, 1), got {own.dropout}")
    cfg = dataclasses.replace(cfg, dropout=own.dropout)
  s, bs, shards = run.executor.model_stages, run.training.batch_size, run.executor.data_parallel
  if not 1 <= s <= cfg.n_layer:
    chunks = f" x {s // run.executor.stages} chunks per device (--schedule {run.executor.schedule})" \
        if s > run.executor.stages else ""
    raise ValueError(f"--stages {run.executor.stages}{chunks}: this GPT-2 has {cfg.n_layer} blocks, so it splits "
                     f"into 1..{cfg.n_layer} stages; pass one of those (or a larger --model)")
  optimizer = optimizer_for(run, own.lr_steps or batching.num_batches(num_train, bs, shards) * run.training.epochs)
  boundary = parse_boundary(run.compression.fwd, run.compression.bwd, num_examples=num_train)
  try:
    built = registry.model_stages(cfg, s, learned_spec, boundary)
  except registry.BottleneckError as err:
    raise ValueError(f"--bottleneck {learned_spec}: {err}") from None
  stages, tied, copies = built.stages, built.tied, ()
  if run.compression.untie_embeddings:
    tied, copies = (), tied
  tied += built.added_ties
  tied_scheme = parse_scheme(run.compression.tied_compression) if run.compression.tied_compression else None
  pipe = Pipeline(stages, boundary, losses.language_model, "tokens", run.executor.microbatches, tied=tied,
                  grad_clip_norm=own.grad_clip, tied_scheme=tied_scheme, init_copies=copies)
  return pipe, optimizer


def build(run: config.RunConfig):
  own, bs, shards, seed = run.options, run.training.batch_size, run.executor.data_parallel, run.training.seed
  corpus = corpus_for(own)
  hub = hub_model(own)
  data = text.load(corpus, tokenizer_for(own, hub), own.block_size, min_blocks=bs)
  train_blocks = data.train[: run.data.train_examples]
  eval_blocks = data.validation[: run.data.eval_examples]
  checks.check_batch_size(bs, len(train_blocks), len(eval_blocks))
  data = text.TextData(data.name, train_blocks, eval_blocks, data.vocab_size)
  example_batch = next(text.train_batches(data, bs, seed, 0, shards))
  if hub is not None:
    cfg, params = gpt2_weights.from_pretrained(str(hub), run.executor.model_stages)
    if run.compression.bottleneck:  # pretrained weights kept; P and Q start as in a fresh run
      params = bottleneck.insert_into(params, bottleneck.parse(run.compression.bottleneck), cfg.n_embd,
                                      jax.random.key(seed))
  else:  # from scratch, or a run trained here: the model the flags give
    cfg, params = model_config(own, data.vocab_size), None
  pipe, optimizer = assemble(run, cfg, len(train_blocks))
  if run_folder(own):  # a run trained here: its weights (checked against the model the flags give)
    step, params = checkpoint_params(run_folder(own) / "ckpt", pipe, optimizer, example_batch)
    print(f"[gpt2_wikitext] fine-tuning the weights of {own.pretrained} after its step {step}")
  return pipe, optimizer, train.Data(
      train_batches=lambda epoch: text.train_batches(data, bs, seed, epoch, shards),
      steps_per_epoch=batching.num_batches(len(train_blocks), bs, shards),
      eval_batches=lambda: text.eval_batches(data, bs), example_batch=example_batch,
      name=data.name, eval_summary=losses.with_perplexity), params


def abstract(run: config.RunConfig):
  """(Pipeline, optimizer, batch shapes, what was assumed) of the run, reading no text and no weights
  (--compile-for): the vocabulary of --tokenizer, the size of --model or of --pretrained (its config.json,
  or a hub name's size), and --train-examples training blocks, else WikiText-2's (assumed) size."""
  own = run.options
  vocab = text.ByteTokenizer().vocab_size if own.tokenizer == "bytes" else gpt2.GPT2Config().vocab_size
  pretrained = own.pretrained
  if run_folder(own):
    cfg = model_config(own, vocab)
  elif pretrained and pathlib.Path(pretrained, "config.json").is_file():
    cfg = gpt2_weights.config_from_hf(json.loads(pathlib.Path(pretrained, "config.json").read_text()))
  elif pretrained:
    if pretrained not in HUB_SIZES:
      raise ValueError(f"--pretrained {pretrained}: --compile-for reads a local folder's config.json or a hub name "
                       f"it knows ({', '.join(HUB_SIZES)}); use --model instead")
    cfg = model_config(own, vocab, HUB_SIZES[pretrained])
  else:
    cfg = model_config(own, vocab)
  num_train, assumed = run.data.train_examples, ""
  if num_train is None:
    num_train = WIKITEXT2_TRAIN_TOKENS // own.block_size
    assumed = (f"{num_train} training blocks (assumed: WikiText-2's ~{WIKITEXT2_TRAIN_TOKENS:,} training tokens / "
               f"{own.block_size}; --train-examples sets it)")
  pipe, optimizer = assemble(run, cfg, num_train)
  bs, shards, block = run.training.batch_size, run.executor.data_parallel, own.block_size
  placeholder = text.TextData("", np.zeros((bs, block), np.int32), np.zeros((bs, block), np.int32), vocab)
  batch = next(text.train_batches(placeholder, bs, run.training.seed, 0, shards))
  return pipe, optimizer, batch, assumed


FLAGS = {
    "bottleneck": ("compression", "learned rank-R projection at every boundary, proj:R or subspace:R (sends z = x P, "
                   "R wide; --fwd/--bwd compress z and its gradient); or ssn[:R], Protocol NanoGPT's ReparamSSN (a "
                   "fixed rank-R subspace; protocol models; sends [c, token ids]: --fwd/--bwd ids+CODEC)", {}),
    "model": ("training", "GPT-2 size, or Protocol NanoGPT's model (protocol-203m) or its 2-CPU-core scale "
              "(protocol-tiny; jaxcomp.models.protocol_gpt)",
              dict(choices=["tiny", "small", "medium", "large", "xl", *PROTOCOL_MODELS])),
    "optimizer": ("training", "adamw: AdamW on every parameter; muon (protocol models): Muon (optax.contrib.muon) on "
                  "the blocks' matrices at --lr, AdamW on the rest", dict(choices=["adamw", "muon"])),
    "weight_decay": ("training", "AdamW's decoupled weight decay (with --optimizer muon: the AdamW groups')",
                     dict(type=float)),
    "cooldown": ("training", "share of the lr schedule, at its end, over which lr falls linearly to 0 (1: from the "
                 "start)", dict(type=float)),
    "lr_steps": ("training", "the lr schedule's length in steps", dict(type=int)),
    "embed_lr": ("training", "--optimizer muon: AdamW's lr for the embedding (unset: Protocol NanoGPT's 0.7)",
                 dict(type=float)),
    "head_lr": ("training", "--optimizer muon: AdamW's lr for the head (unset: 0.004)", dict(type=float)),
    "scalar_lr": ("training", "--optimizer muon: AdamW's lr for biases and gains (unset: 0.015)", dict(type=float)),
    "muon_weight_decay": ("training", "--optimizer muon: Muon's weight decay (unset: 0.05)", dict(type=float)),
    "outliers": ("training", "N:SCALE[:MASSIVE]: what crosses the stage boundaries carries N residual channels "
                 "times SCALE and MASSIVE added at the first token in two of them, as pretrained transformers' "
                 "residual streams do (same model function; jaxcomp.models.gpt2), e.g. 4:64:1024", {}),
    "pretrained": ("training", "what to fine-tune from: a run trained here (its folder, OUT/RUN_NAME: the weights of "
                   "its newest checkpoint; give the model flags it had), or a Hugging Face GPT-2 (a folder or a "
                   "hub name such as gpt2)", {}),
    "dropout": ("training", "dropout rate (default: the model's, 0.1)", dict(type=float)),
    "tokenizer": ("data", "byte tokens or GPT-2 BPE (--tokenizer-dir)", dict(choices=text.TOKENIZERS)),
    "tokenizer_dir": ("data", "folder with GPT-2's vocab.json and merges.txt", {}),
    "train_file": ("data", "training text (raw or tokenized WikiText, any name)", {}),
    "valid_file": ("data", "evaluation text (default: the last 10%% of --train-file's articles)", {}),
    "data_dir": ("data", "folder with wiki.{train,valid}.raw or wiki.{train,valid}.tokens (default: the "
                 "WikiText-2 validation text shipped with jaxcomp)", {}),
    "data": ("data", "download the papers' text from the Hugging Face hub (pip install -e .[data]): wikitext2-raw "
             "(WikiText-2 raw v1, train and validation) or wikitext103-raw", dict(choices=list(hub_text.HUB_TEXTS))),
    "block_size": ("data", "tokens per example", dict(type=int)),
    "model_width": ("training", "the width of --model tiny (default 64; a multiple of its 4 heads: depth and heads "
                    "kept) or protocol-tiny (default 128; a multiple of its head dim, 32: depth and head dim kept)",
                    dict(type=int)),
    "text": ("data", "a text shipped with jaxcomp (jaxcomp/data/TEXTS_README.md): the WikiText-2 validation text "
             "(default), tiny Shakespeare, the King James Bible, or long (all three: ~5.7 M training bytes)",
             dict(choices=text.SHIPPED_TEXTS)),
}


EXPERIMENT = config.Experiment("gpt2_wikitext", RECIPES, "tiny", PRESETS, build, abstract, Options, FLAGS,
                               paper.gpt2_row)

if __name__ == "__main__":
  cli.main(EXPERIMENT)
