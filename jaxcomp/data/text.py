"""Language-model data: text from any files (raw or tokenized WikiText), or a text shipped with jaxcomp (the
WikiText-2 validation text, tiny Shakespeare, the King James Bible: `SHIPPED_TEXTS`, TEXTS_README.md); byte tokens
or GPT-2's BPE.

Each split's text is tokenised whole, and cut into non-overlapping blocks of `block_size`
tokens (the remainder dropped); block i has example id i (AQ-SGD's buffer row). A `Corpus`
and a tokenizer each carry a `name` saying what they are, and `TextData.name` joins both so
every output labels its data.
"""
import dataclasses
import functools
import gzip
import pathlib
import re

import numpy as np

from jaxcomp.data import batching

SHIPPED_FILE = pathlib.Path(__file__).with_name("wikitext2_valid.txt")  # notice: WIKITEXT2_README.md
# the shipped public-domain texts (TEXTS_README.md: source, licence, checksum), gzip-compressed
SHIPPED_GZ = {"shakespeare": ("shakespeare.txt.gz", "tiny Shakespeare (public domain)"),
              "kjv": ("kjv.txt.gz", "the King James Bible (public domain)")}
SHIPPED_TEXTS = ("wikitext2", *SHIPPED_GZ, "long")  # `long`: all three, each split on its own
EVAL_FRACTION = 0.1  # of the articles, the last ones, when one text is split into train/eval
DATA_DIR_FILES = {"train": ("wiki.train.raw", "wiki.train.tokens"),
                  "validation": ("wiki.valid.raw", "wiki.valid.tokens")}
TOKENIZERS = ("bytes", "gpt2")
ARTICLE_HEADING = re.compile(r"^ = [^=].* = *$", re.MULTILINE)  # " = Title = "; sections are " = = X = = "


@dataclasses.dataclass(frozen=True)
class Corpus:
  name: str  # what the text is, e.g. "WikiText-2 validation split (tokenized release) ..."
  train: str
  validation: str


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255; 256 is end-of-text. vocab_size = 257."""
  vocab_size: int = 257
  name: str = "byte tokens"

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


# GPT-2's pre-tokenizer never joins a newline with the non-space text after it (" ?\S" starts a
# new piece), so the text can be cut there and the pieces encoded in parallel, identically.
_INDEPENDENT_PIECES = re.compile(r"(?<=\n)(?= ?\S)")


@dataclasses.dataclass(frozen=True)
class BPETokenizer:
  """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`, run by the `tokenizers` library
  (built once per tokenizer object)."""
  vocab_file: str
  merges_file: str

  @functools.cached_property
  def model(self):
    from tokenizers import ByteLevelBPETokenizer
    return ByteLevelBPETokenizer(self.vocab_file, self.merges_file)

  @property
  def name(self) -> str:
    return f"GPT-2 BPE ({pathlib.Path(self.vocab_file).parent})"

  @property
  def vocab_size(self) -> int:
    return self.model.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    pieces = self.model.encode_batch(_INDEPENDENT_PIECES.split(text))
    return [i for piece in pieces for i in piece.ids]

  def decode(self, ids) -> str:
    return self.model.decode([int(i) for i in ids])


def tokenizer(kind: str, tokenizer_dir=None):
  """"bytes", or "gpt2" from `tokenizer_dir` with vocab.json and merges.txt."""
  if kind == "bytes":
    return ByteTokenizer()
  if kind != "gpt2":
    raise ValueError(f"unknown tokenizer {kind!r}; expected one of {TOKENIZERS}")
  if tokenizer_dir is None:
    raise ValueError("the gpt2 tokenizer needs a folder with GPT-2's vocab.json and merges.txt (--tokenizer-dir)")
  files = [pathlib.Path(tokenizer_dir) / f for f in ("vocab.json", "merges.txt")]
  missing = [str(f) for f in files if not f.is_file()]
  if missing:
    raise FileNotFoundError(f"GPT-2 tokenizer file not found: {', '.join(missing)}")
  return BPETokenizer(*map(str, files))


def read_text(path) -> str:
  """The UTF-8 text of `path`; a missing, empty or undecodable file is named in the error."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"text file not found: {path}")
  try:
    content = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as err:
    raise ValueError(f"{path} is not UTF-8 text ({err})") from None
  if not content.strip():
    raise ValueError(f"{path} is empty")
  return content


def split_articles(content: str, source: str, eval_fraction: float = EVAL_FRACTION) -> tuple[str, str, str]:
  """(train text, eval text, how): the last `eval_fraction` of the WikiText articles (at least
  one; an article starts at a " = Title = " line) are the eval text."""
  starts = [m.start() for m in ARTICLE_HEADING.finditer(content)]
  if len(starts) < 2:
    raise ValueError(f"{source} has {len(starts)} WikiText article headings (' = Title = ' lines), too few to split "
                     "into train and eval by article; give the eval text as its own file")
  n_eval = max(1, round(eval_fraction * len(starts)))
  how = f"articles 1-{len(starts) - n_eval} train, {len(starts) - n_eval + 1}-{len(starts)} eval"
  return content[: starts[-n_eval]], content[starts[-n_eval]:], how


def split_paragraphs(content: str, eval_fraction: float = EVAL_FRACTION) -> tuple[str, str, str]:
  """(train text, eval text, how): cut at the last blank line before 1 - `eval_fraction` of the text (at the
  character itself if there is none)."""
  at = round(len(content) * (1 - eval_fraction))
  blank = content.rfind("\n\n", 0, at)
  cut = blank + 2 if blank > 0 else at
  return content[:cut], content[cut:], f"the first {cut / len(content):.0%} train, the rest eval (cut at a blank line)"


def shipped_corpus(name: str = "wikitext2") -> Corpus:
  """A text shipped with jaxcomp (`SHIPPED_TEXTS`): the WikiText-2 validation text (60 articles, split by article),
  tiny Shakespeare or the King James Bible (split at a blank line, `split_paragraphs`), or `long`, all three."""
  if name == "wikitext2":
    train, validation, how = split_articles(read_text(SHIPPED_FILE), str(SHIPPED_FILE))
    return Corpus(f"WikiText-2 validation split (tokenized release, CC BY-SA 3.0; shipped with jaxcomp), {how} "
                  "(NOT the papers' WikiText-2 train/test)", train, validation)
  if name == "long":
    parts = [shipped_corpus(n) for n in ("kjv", "shakespeare", "wikitext2")]
    return Corpus("; ".join(p.name for p in parts), "".join(p.train for p in parts),
                  "".join(p.validation for p in parts))
  if name not in SHIPPED_GZ:
    raise ValueError(f"--text {name!r}: the shipped texts are {', '.join(SHIPPED_TEXTS)}")
  file, what = SHIPPED_GZ[name]
  train, validation, how = split_paragraphs(gzip.decompress(pathlib.Path(__file__).with_name(file).read_bytes())
                                            .decode("utf-8"))
  return Corpus(f"{what}, shipped with jaxcomp, {how}", train, validation)


def files_corpus(train_file, valid_file=None) -> Corpus:
  """Text from any files; without `valid_file` the train file is split by article."""
  content = read_text(train_file)
  if valid_file is not None:
    return Corpus(f"text files {train_file} (train), {valid_file} (eval)", content, read_text(valid_file))
  train, validation, how = split_articles(content, str(train_file))
  return Corpus(f"text file {train_file}, {how}", train, validation)


def data_dir_corpus(data_dir) -> Corpus:
  """WikiText-2 from `data_dir` (searched recursively): wiki.{train,valid}.raw (raw release)
  or wiki.{train,valid}.tokens (tokenized release); a test file is not needed."""
  root = pathlib.Path(data_dir)
  if not root.is_dir():
    raise FileNotFoundError(f"--data-dir {root} is not a folder (expected wiki.train.raw and wiki.valid.raw, "
                            "or wiki.train.tokens and wiki.valid.tokens, in it)")
  found = {}
  for split, names in DATA_DIR_FILES.items():
    matches = sorted(p for name in names for p in root.rglob(name))
    if not matches:
      raise FileNotFoundError(f"no {' or '.join(names)} under {root}; name the files with --train-file/--valid-file")
    found[split] = matches[0]
  corpus = files_corpus(found["train"], found["validation"])
  return dataclasses.replace(corpus, name="WikiText-2 " + corpus.name)


def blocks(token_ids, block_size: int) -> np.ndarray:
  """int32 [N, block_size]: consecutive non-overlapping blocks, remainder dropped."""
  ids = np.asarray(token_ids, np.int32)
  if block_size < 2:
    raise ValueError(f"block_size must be >= 2, got {block_size}")
  n = len(ids) // block_size
  if n == 0:
    raise ValueError(f"block_size {block_size} is larger than the corpus ({len(ids)} tokens)")
  return ids[: n * block_size].reshape(n, block_size)


@dataclasses.dataclass(frozen=True)
class TextData:
  name: str
  train: np.ndarray  # int32 [N, T]
  validation: np.ndarray
  vocab_size: int


def load(corpus: Corpus, tok, block_size: int, min_blocks: int = 1) -> TextData:
  """`corpus` tokenised by `tok` (a ByteTokenizer or BPETokenizer) into blocks; a ValueError naming the
  block size that fits if a split makes fewer than `min_blocks` (e.g. one batch)."""
  def split_blocks(split, content):
    ids = tok.encode(content)
    n = len(ids) // max(block_size, 1)
    if block_size >= 2 and n < min_blocks:  # (blocks() refuses block sizes below 2)
      few = "is larger than the corpus" if n == 0 else f"makes {n} examples, fewer than the {min_blocks} of one batch"
      raise ValueError(f"the {split} text of {corpus.name} ({len(ids):,} tokens): block_size {block_size} {few}; "
                       f"use --block-size {len(ids) // min_blocks} or less"
                       + (" (or a smaller --batch-size)" if min_blocks > 1 else ""))
    return blocks(ids, block_size)
  return TextData(f"{corpus.name}; {tok.name}", split_blocks("train", corpus.train),
                  split_blocks("eval", corpus.validation), tok.vocab_size)


def train_batches(data: TextData, batch_size: int, seed: int, epoch: int, shards: int = 1):
  return batching.iterate({"tokens": data.train}, batch_size, seed, epoch, shuffle=True, shards=shards)


def eval_batches(data: TextData, batch_size: int):
  return batching.iterate({"tokens": data.validation}, batch_size, 0, 0, shuffle=False)
