"""Dataset loaders on small files written here in the real formats; batching determinism."""
import json
import pickle

import numpy as np
import pytest

from jaxcomp.data import batching, cifar10, text


def _write_cifar(directory, per_file=4):
  rng = np.random.default_rng(0)
  folder = directory / "cifar-10-batches-py"
  folder.mkdir()
  written = {}
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)  # rows: 1024 R, 1024 G, 1024 B
    labels = rng.integers(0, 10, per_file).tolist()
    with open(folder / name, "wb") as f:
      pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
    written[name] = (data, labels)
  return written


def test_cifar10_pickle_files(tmp_path):
  written = _write_cifar(tmp_path)
  data = cifar10.load("files", tmp_path)
  assert data.name == "CIFAR-10"
  assert data.train["image"].shape == (20, 32, 32, 3) and data.test["image"].shape == (4, 32, 32, 3)
  raw, labels = written["data_batch_2"]
  # image 1 of batch 2 is train image 5; pixel (row 3, col 7) of channel G is at 1024 + 3*32 + 7
  assert data.train["image"][5, 3, 7, 1] == raw[1, 1024 + 3 * 32 + 7]
  assert data.train["label"][5] == labels[1]
  assert cifar10.load("auto", tmp_path).name == "CIFAR-10"


def test_cifar10_errors(tmp_path):
  with pytest.raises(ValueError, match="unknown CIFAR-10 source 'imagenet'"):
    cifar10.load("imagenet")
  with pytest.raises(FileNotFoundError, match="data_batch_1"):
    cifar10.load("files", tmp_path)
  with pytest.raises(ValueError, match="needs data_dir"):
    cifar10.load("files")


def test_an_explicit_data_dir_loads_or_names_what_it_expected(tmp_path):
  (tmp_path / "empty").mkdir()
  for folder in (tmp_path / "empty", tmp_path / "typo"):  # never the synthetic stand-in
    with pytest.raises(FileNotFoundError, match=f"CIFAR-10 (--data-dir {folder} is not a folder|in {folder}: expected "
                                                f"{folder / 'cifar-10-batches-py'}/{{data_batch_1,)"):
      cifar10.load("auto", folder)
  _write_cifar(tmp_path)
  path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
  path.write_bytes(path.read_bytes()[:500])  # truncated download
  with pytest.raises(ValueError, match=f"{path} is not a CIFAR-10 python batch file \\(UnpicklingError"):
    cifar10.load("auto", tmp_path)
  path.write_bytes(pickle.dumps({b"data": np.zeros((3, 3072), np.uint8), b"labels": [1, 2]}))
  with pytest.raises(ValueError, match=f"{path} holds 3 images but 2 labels"):
    cifar10.load("files", tmp_path)


def test_tfds_cifar10_with_mock_data():
  """tensorflow-datasets (the `data` extra, plus tensorflow for tfds.load) is not in the `test`
  extra: this test runs where both are installed and is skipped elsewhere."""
  tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets not installed (pip install -e .[data])")
  pytest.importorskip("tensorflow", reason="tfds.load(batch_size=-1) needs tensorflow, which is not installed")
  with tfds.testing.mock_data(num_examples=12):
    data = cifar10.load("tfds")
    assert cifar10.load("auto").name == data.name == "CIFAR-10 (tensorflow-datasets)"
  for split in (data.train, data.test):
    assert split["image"].shape == (12, 32, 32, 3) and split["image"].dtype == np.uint8
    assert split["label"].dtype == np.int32 and 0 <= split["label"].min() and split["label"].max() < 10
  batch = next(cifar10.train_batches(data, 4, 0, 0))
  assert batch["image"].shape == (4, 32, 32, 3) and batch["image"].dtype == np.float32


def test_synthetic_stand_in_is_labelled_and_learnable():
  data = cifar10.synthetic(2000, 500)
  assert "NOT CIFAR-10" in data.name
  x = cifar10.normalise(data.train["image"]).reshape(2000, -1)
  means = np.stack([x[data.train["label"] == c].mean(0) for c in range(10)])
  test = cifar10.normalise(data.test["image"]).reshape(500, -1)
  predicted = np.argmax(test @ means.T - 0.5 * (means**2).sum(1), axis=1)
  assert (predicted == data.test["label"]).mean() > 0.5  # chance is 0.1


def test_augmentation_crops_and_flips_deterministically():
  images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
  a = cifar10.augment(images, np.random.default_rng(1))
  b = cifar10.augment(images, np.random.default_rng(1))
  np.testing.assert_array_equal(a, b)
  assert a.shape == images.shape and a.dtype == np.uint8
  padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
  found = []  # the (dy, dx, flipped) that produced each output
  for i in range(64):
    matches = [(dy, dx, f) for dy in range(9) for dx in range(9) for f in (0, 1)
               if np.array_equal(a[i], (lambda c: c[:, ::-1] if f else c)(padded[i, dy:dy + 32, dx:dx + 32]))]
    assert matches, f"output {i} is no crop/flip of its input"
    found.append(matches[0])
  assert 15 < sum(f for _, _, f in found) < 49  # about half flipped
  assert len({(dy, dx) for dy, dx, _ in found}) > 20  # offsets vary over the 9x9 range


def test_batches_are_deterministic_per_seed_and_epoch():
  arrays = {"x": np.arange(50)}
  epoch1 = [b["x"].tolist() for b in batching.iterate(arrays, 8, seed=3, epoch=1)]
  assert epoch1 == [b["x"].tolist() for b in batching.iterate(arrays, 8, seed=3, epoch=1)]
  assert epoch1 != [b["x"].tolist() for b in batching.iterate(arrays, 8, seed=3, epoch=2)]
  assert len(epoch1) == 6 and len(set(sum(epoch1, []))) == 48  # remainder dropped, no repeats
  first = next(batching.iterate(arrays, 8, seed=3, epoch=1))
  np.testing.assert_array_equal(first["id"], first["x"])
  with pytest.raises(ValueError, match=r"batch_size must be in 1..50 \(the split's size\), got 64"):
    next(batching.iterate(arrays, 64, 0, 0))


def test_blocks_and_the_shipped_wikitext2_text():
  np.testing.assert_array_equal(text.blocks(range(10), 3), [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
  with pytest.raises(ValueError, match="block_size 20 is larger than the corpus"):
    text.blocks(range(10), 20)
  corpus = text.shipped_corpus()
  assert corpus.name.startswith("WikiText-2 validation split (tokenized release")
  assert "articles 1-54 train, 55-60 eval" in corpus.name
  whole = text.SHIPPED_FILE.read_text(encoding="utf-8")
  assert corpus.train + corpus.validation == whole and len(whole.encode()) == 1_121_681  # nothing lost
  assert corpus.validation.startswith(" = ") and len(text.ARTICLE_HEADING.findall(corpus.validation)) == 6
  assert (text.SHIPPED_FILE.parent / "WIKITEXT2_README.md").read_text().count("CC BY-SA 3.0") == 1
  data = text.load(corpus, text.ByteTokenizer(), 64)
  assert data.name == corpus.name + "; byte tokens" and data.vocab_size == 257
  assert data.train.shape == (len(corpus.train.encode()) // 64, 64) and data.validation.shape[0] > 100
  assert text.ByteTokenizer().decode(data.validation[0][:20]).startswith(" = ")
  with pytest.raises(ValueError, match="unknown tokenizer 'ptb'"):
    text.tokenizer("ptb")


def _write_bpe(directory):
  from tokenizers import pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  vocab = {ch: i for i, ch in enumerate(alphabet)}
  merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("Ċ", "Ċ"), ("Ġ", "Ċ"), ("Ċ", "Ġ")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  (directory / "vocab.json").write_text(json.dumps(vocab))
  (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
  return vocab


WIKI = " = Title = \n \n the cat sat on the mat . the end \n\n\n = = Part = = \n  the  \n \n"


def test_gpt2_bpe_is_built_once_and_encodes_the_whole_text_exactly(tmp_path):
  vocab = _write_bpe(tmp_path)
  tok = text.tokenizer("gpt2", tmp_path)
  assert tok.model is tok.model  # built once, then cached
  ids = tok.encode(" the cat")
  assert ids[0] == vocab["Ġthe"] and tok.decode(ids) == " the cat"
  corpus = WIKI * 3
  assert tok.encode(corpus) == tok.model.encode(corpus).ids  # cutting at newlines changes nothing
  assert vocab["ĊĊ"] in tok.encode(corpus) and tok.decode(tok.encode(corpus)) == corpus
  with pytest.raises(FileNotFoundError, match="GPT-2 tokenizer file not found: .*merges.txt"):
    (tmp_path / "merges.txt").unlink()
    text.tokenizer("gpt2", tmp_path)
  with pytest.raises(ValueError, match="needs a folder with GPT-2's vocab.json"):
    text.tokenizer("gpt2")


@pytest.mark.parametrize("suffix", ["raw", "tokens"])
def test_wikitext2_data_dir_raw_or_tokenized_without_a_test_file(tmp_path, suffix):
  vocab = _write_bpe(tmp_path)
  (tmp_path / "wt").mkdir()
  (tmp_path / "wt" / f"wiki.train.{suffix}").write_text(WIKI * 20)
  (tmp_path / "wt" / f"wiki.valid.{suffix}").write_text(WIKI * 5)
  tok = text.tokenizer("gpt2", tmp_path)
  data = text.load(text.data_dir_corpus(tmp_path), tok, 16)
  assert data.name.startswith(f"WikiText-2 text files {tmp_path / 'wt' / f'wiki.train.{suffix}'} (train)")
  assert data.vocab_size == len(vocab)
  np.testing.assert_array_equal(data.train.reshape(-1), tok.encode(WIKI * 20)[: data.train.size])
  (tmp_path / "wt" / f"wiki.valid.{suffix}").unlink()
  with pytest.raises(FileNotFoundError, match=f"no wiki.valid.raw or wiki.valid.tokens under {tmp_path}"):
    text.data_dir_corpus(tmp_path)
  with pytest.raises(FileNotFoundError, match="--data-dir .*nowhere is not a folder"):
    text.data_dir_corpus(tmp_path / "nowhere")


def test_text_files_any_names_split_by_article_or_not(tmp_path):
  articles = "".join(f" = Article {i} = \n \n text of article {i} . \n" for i in range(1, 21))
  (tmp_path / "mine.txt").write_text(articles)
  corpus = text.files_corpus(tmp_path / "mine.txt")
  assert corpus.name == f"text file {tmp_path / 'mine.txt'}, articles 1-18 train, 19-20 eval"
  assert corpus.validation.startswith(" = Article 19 = ") and corpus.train + corpus.validation == articles
  (tmp_path / "ev.txt").write_text("held out")
  assert text.files_corpus(tmp_path / "mine.txt", tmp_path / "ev.txt").validation == "held out"
  (tmp_path / "flat.txt").write_text("no headings here\n" * 50)
  with pytest.raises(ValueError, match="flat.txt has 0 WikiText article headings .* give the eval text as its own"):
    text.files_corpus(tmp_path / "flat.txt")
  (tmp_path / "empty.txt").write_text(" \n")
  with pytest.raises(ValueError, match="empty.txt is empty"):
    text.files_corpus(tmp_path / "empty.txt")
  (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
  with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):
    text.files_corpus(tmp_path / "latin1.txt")
  with pytest.raises(ValueError, match="the eval text of .*: block_size 64 is larger than the corpus"):
    text.load(text.files_corpus(tmp_path / "mine.txt", tmp_path / "ev.txt"), text.ByteTokenizer(), 64)
