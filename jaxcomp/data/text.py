"""Language-model data: Wikitext-2 (raw v1), GPT-2 BPE, and an offline stand-in corpus.

Text is tokenised whole, concatenated and cut into non-overlapping blocks of `block_size`
tokens (the remainder dropped); block i has example id i (AQ-SGD's buffer row).
"""
import dataclasses
import pathlib

import numpy as np

from jaxcomp.data import batching

SPLIT_FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}
OFFLINE_NAME = "generated English-like corpus, byte tokens (offline stand-in, NOT Wikitext-2)"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255; 256 is end-of-text. vocab_size = 257."""
  vocab_size: int = 257

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class BPETokenizer:
  """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`, run by the `tokenizers` library."""
  vocab_file: str
  merges_file: str

  @property
  def _impl(self):
    from tokenizers import ByteLevelBPETokenizer
    return ByteLevelBPETokenizer(self.vocab_file, self.merges_file)

  @property
  def vocab_size(self) -> int:
    return self._impl.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._impl.encode(text).ids

  def decode(self, ids) -> str:
    return self._impl.decode([int(i) for i in ids])


def load_wikitext2(data_dir=None) -> dict[str, str]:
  """{split: raw text} from wiki.{train,valid,test}.raw in data_dir, or from the HF hub."""
  if data_dir is not None:
    root = pathlib.Path(data_dir)
    out = {}
    for split, name in SPLIT_FILES.items():
      matches = [root / name] if (root / name).exists() else list(root.rglob(name))
      if not matches:
        raise FileNotFoundError(f"Wikitext-2 file {name} not found under {root}")
      out[split] = matches[0].read_text(encoding="utf-8")
    return out
  try:
    import datasets
  except ImportError:
    raise ImportError("Wikitext-2 needs data_dir (wiki.*.raw files) or the `datasets` package "
                      "(pip install -e .[data])") from None
  ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1")
  return {split: "".join(ds[split]["text"]) for split in SPLIT_FILES}


_WORDS = {
    "det": "the a every one this that some no".split(),
    "adj": "old new small large quiet bright dark early late green heavy quick careful ancient".split(),
    "noun": "river city engineer garden machine letter village teacher bridge signal market winter "
            "captain forest network library harbour student".split(),
    "verb": "crossed repaired found opened followed built watched carried measured described".split(),
    "adv": "slowly quickly carefully again finally later together quietly".split(),
    "prep": "near under behind beside across through".split(),
}


def offline_corpus(sentences: int = 12000, seed: int = 0) -> dict[str, str]:
  """A generated English-like corpus (templates over fixed word lists): learnable, offline."""
  rng = np.random.default_rng(seed)
  pick = lambda kind: _WORDS[kind][rng.integers(len(_WORDS[kind]))]

  def sentence():
    subject = f"{pick('det')} {pick('adj')} {pick('noun')}"
    s = f"{subject} {pick('verb')} {pick('det')} {pick('noun')}"
    if rng.random() < 0.5:
      s += f" {pick('prep')} {pick('det')} {pick('adj')} {pick('noun')}"
    if rng.random() < 0.3:
      s += f" {pick('adv')}"
    return s[0].upper() + s[1:] + "."

  text = [sentence() for _ in range(sentences)]
  cut = int(0.9 * sentences)
  return {"train": " ".join(text[:cut]), "validation": " ".join(text[cut:]), "test": " ".join(text[cut:])}


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


def load(source: str, block_size: int, data_dir=None, tokenizer_dir=None) -> TextData:
  """"offline": generated corpus + bytes; "wikitext2": Wikitext-2 raw + GPT-2 BPE (tokenizer_dir
  holds vocab.json and merges.txt)."""
  if source == "offline":
    text, tok, name = offline_corpus(), ByteTokenizer(), OFFLINE_NAME
  elif source == "wikitext2":
    if tokenizer_dir is None:
      raise ValueError("wikitext2 needs tokenizer_dir with GPT-2's vocab.json and merges.txt")
    tdir = pathlib.Path(tokenizer_dir)
    for f in ("vocab.json", "merges.txt"):
      if not (tdir / f).exists():
        raise FileNotFoundError(f"GPT-2 tokenizer file not found: {tdir / f}")
    text, name = load_wikitext2(data_dir), "Wikitext-2 (raw v1), GPT-2 BPE"
    tok = BPETokenizer(str(tdir / "vocab.json"), str(tdir / "merges.txt"))
  else:
    raise ValueError(f"unknown text source {source!r}; expected 'offline' or 'wikitext2'")
  return TextData(name, blocks(tok.encode(text["train"]), block_size),
                  blocks(tok.encode(text["validation"]), block_size), tok.vocab_size)


def train_batches(data: TextData, batch_size: int, seed: int, epoch: int, shards: int = 1):
  return batching.iterate({"tokens": data.train}, batch_size, seed, epoch, shuffle=True, shards=shards)


def eval_batches(data: TextData, batch_size: int):
  return batching.iterate({"tokens": data.validation}, batch_size, 0, 0, shuffle=False)
