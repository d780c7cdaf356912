"""The papers' text from the Hugging Face hub: WikiText-2 raw v1 (and WikiText-103) through `datasets`.

`pip install -e .[data]` brings Hugging Face `datasets`; `hub_corpus("wikitext2-raw")` downloads the release once
(into `datasets`' cache, `HF_DATASETS_CACHE` or ~/.cache/huggingface) and gives its train and validation splits.
Each split is a table of rows, one per line of the raw release's file (`wiki.train.raw`), its newline kept and
blank lines empty; a split's text is its rows joined, as Hugging Face's language-modelling example (`run_clm`,
the papers' trainer) concatenates them before cutting blocks.
"""
import importlib

from jaxcomp.data.text import Corpus

# --data name -> (hub dataset, configuration, what it is)
HUB_TEXTS = {
    "wikitext2-raw": ("Salesforce/wikitext", "wikitext-2-raw-v1",
                      "WikiText-2 raw v1 (CC BY-SA 3.0; Hugging Face Salesforce/wikitext), train and validation"),
    "wikitext103-raw": ("Salesforce/wikitext", "wikitext-103-raw-v1",
                        "WikiText-103 raw v1 (CC BY-SA 3.0; Hugging Face Salesforce/wikitext), train and validation"),
}


def split_text(rows) -> str:
  """A split's text: its rows' `text` joined (each row one line of the release, newline included)."""
  return "".join(rows["text"])


def hub_corpus(name: str, cache_dir=None, load_dataset=None) -> Corpus:
  """The train and validation splits of `name` (`HUB_TEXTS`), downloaded by `datasets.load_dataset` (or
  `load_dataset`, which takes the same arguments) into `cache_dir` (None: datasets' own cache)."""
  if name not in HUB_TEXTS:
    raise ValueError(f"--data {name!r}: choose one of {', '.join(HUB_TEXTS)}")
  repo, configuration, what = HUB_TEXTS[name]
  if load_dataset is None:
    try:
      load_dataset = importlib.import_module("datasets").load_dataset
    except ImportError:
      raise ValueError(f"--data {name} downloads {repo} ({configuration}) with Hugging Face datasets, which is not "
                       "installed: pip install -e .[data] (or give the release's files with --data-dir DIR)") from None
  splits = load_dataset(repo, configuration, cache_dir=cache_dir)
  missing = [s for s in ("train", "validation") if s not in splits]
  if missing:
    raise ValueError(f"--data {name}: {repo} ({configuration}) has no {' or '.join(missing)} split")
  return Corpus(what, split_text(splits["train"]), split_text(splits["validation"]))
