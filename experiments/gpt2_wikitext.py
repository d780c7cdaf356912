"""GPT-2 fine-tuned on Wikitext-2 in 4 pipeline stages: Rudakov Table 5 and AQ-SGD rows as presets.

    python -m experiments.gpt2_wikitext --preset top10-reuse --pretrained gpt2 \\
        --data-source wikitext2 --data-dir WIKITEXT_DIR --tokenizer-dir GPT2_DIR
    python -m experiments.gpt2_wikitext --preset aqsgd-fw2-bw4      # offline default

Recipe (HF Trainer defaults): 4 epochs, batch 8, AdamW lr 5e-5 linearly decayed to 0, weight
decay 0, gradient clipping at norm 1.0, blocks of 1024 tokens, GPT-2 small cut after blocks
2, 5, 8. Offline default (no internet): a tiny GPT-2 trained from scratch on a generated
corpus with byte tokens, labelled as such in the output.
"""
import optax

from experiments import common
from jaxcomp import losses, train
from jaxcomp.data import batching, text
from jaxcomp.models import gpt2, gpt2_weights
from jaxcomp.pipeline import Pipeline
from jaxcomp.spec import parse_boundary

RECIPE = dict(fwd="none", bwd="none", epochs=4, batch_size=8, microbatches=1, stages=4, lr=5e-5, seed=0,
              weight_decay=0.0, grad_clip=1.0, data_source="wikitext2", data_dir=None, tokenizer_dir=None,
              model="small", pretrained=None, block_size=1024)
OFFLINE = dict(data_source="offline", model="tiny", block_size=128, lr=1e-3, epochs=2)


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


def build(config):
  if config["data_source"] == "offline":
    data = text.load("offline", config["block_size"])
  else:
    data = text.load("wikitext2", config["block_size"], config["data_dir"], config["tokenizer_dir"])
  train_blocks = data.train[: config.get("train_examples")]
  eval_blocks = data.validation[: config.get("eval_examples")]
  data = text.TextData(data.name, train_blocks, eval_blocks, data.vocab_size)
  s = config["stages"]
  if config["pretrained"]:
    cfg, params = gpt2_weights.from_pretrained(config["pretrained"], s)
  else:
    base = getattr(gpt2.GPT2Config, config["model"])()
    cfg, params = gpt2.GPT2Config(**{**base.__dict__, "vocab_size": data.vocab_size,
                                     "n_positions": max(base.n_positions, config["block_size"])}), None
  bs, shards = config["batch_size"], config.get("data_parallel") or 1
  steps = batching.num_batches(len(train_blocks), bs, shards) * config["epochs"]
  schedule = optax.linear_schedule(config["lr"], 0.0, steps)
  optimizer = optax.adamw(schedule, weight_decay=config["weight_decay"])
  boundary = parse_boundary(config["fwd"], config["bwd"], num_examples=len(train_blocks))
  pipe = Pipeline(gpt2.gpt2_stages(cfg, s), boundary, losses.language_model, "tokens", config["microbatches"],
                  tied=gpt2.gpt2_tied(s), grad_clip_norm=config["grad_clip"])
  example = next(text.train_batches(data, bs, config["seed"], 0, shards))
  return pipe, optimizer, train.Data(
      train_batches=lambda epoch: text.train_batches(data, bs, config["seed"], epoch, shards),
      steps_per_epoch=batching.num_batches(len(train_blocks), bs, shards),
      eval_batches=lambda: text.eval_batches(data, bs), example_batch=example, name=data.name,
      eval_summary=losses.with_perplexity), params


def _flags(parser):
  parser.add_argument("--model", choices=["tiny", "small", "medium", "large", "xl"], help="GPT-2 size")
  parser.add_argument("--pretrained", help="HF GPT-2 directory or hub name to fine-tune from")
  parser.add_argument("--data-source", choices=["offline", "wikitext2"], help="corpus")
  parser.add_argument("--data-dir", help="folder with wiki.{train,valid,test}.raw")
  parser.add_argument("--tokenizer-dir", help="folder with GPT-2's vocab.json and merges.txt")
  parser.add_argument("--block-size", type=int, help="tokens per example")


def recipe(args):
  """The paper's recipe when Wikitext-2 is asked for; otherwise the offline default."""
  wants_wikitext = args.data_source == "wikitext2" or args.data_dir is not None
  return RECIPE if wants_wikitext else {**RECIPE, **OFFLINE}


EXPERIMENT = common.Experiment("gpt2_wikitext", recipe, PRESETS, build, _flags)

if __name__ == "__main__":
  common.main(EXPERIMENT)
