"""CIFAR-10: the original python-pickle files, tensorflow-datasets, or a labelled offline stand-in
(only when no data folder is given).

Images are uint8 [N, 32, 32, 3] until batching; training batches get the standard random
crop (4-pixel zero padding) and horizontal flip, then per-channel normalisation.
"""
import dataclasses
import pathlib
import pickle

import numpy as np

from jaxcomp.data import batching

MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)
SOURCES = ("auto", "files", "tfds", "synthetic")
SYNTHETIC_NAME = "synthetic 10-class 32x32 images (offline stand-in, NOT CIFAR-10)"


@dataclasses.dataclass(frozen=True)
class ImageData:
  name: str
  train: dict  # {"image": uint8 [N,32,32,3], "label": int32 [N]}
  test: dict
  num_classes: int = 10


BATCH_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


def _read_pickles(directory: pathlib.Path, names) -> dict:
  images, labels = [], []
  for name in names:
    path = directory / name
    if not path.exists():
      raise FileNotFoundError(f"CIFAR-10 batch file not found: {path}")
    try:
      with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
      image = np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
      label = np.asarray(d[b"labels"], np.int32)
    except Exception as err:  # truncated, not a pickle, another format
      raise ValueError(f"{path} is not a CIFAR-10 python batch file ({type(err).__name__}: {err}); "
                       "download and unpack cifar-10-python.tar.gz again") from None
    if len(image) != len(label):
      raise ValueError(f"{path} holds {len(image)} images but {len(label)} labels; "
                       "download and unpack cifar-10-python.tar.gz again")
    images.append(image)
    labels.append(label)
  return {"image": np.concatenate(images), "label": np.concatenate(labels)}


def _from_files(data_dir) -> ImageData:
  root = pathlib.Path(data_dir)
  directory = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
  return ImageData("CIFAR-10", *(_read_pickles(directory, BATCH_FILES[s]) for s in ("train", "test")))


def _from_tfds(data_dir) -> ImageData:
  import tensorflow_datasets as tfds
  # one batch larger than either split holds each whole split (batch_size=-1 aborts tf 2.21 on mock data)
  splits = tfds.load("cifar10", split=["train", "test"], batch_size=60_000, data_dir=data_dir)
  to = lambda d: {"image": np.asarray(d["image"], np.uint8), "label": np.asarray(d["label"], np.int32)}
  return ImageData("CIFAR-10 (tensorflow-datasets)", *[to(next(iter(tfds.as_numpy(d)))) for d in splits])


def synthetic(num_train: int = 5000, num_test: int = 1000, seed: int = 0) -> ImageData:
  """A learnable 10-class image set: per-class smooth colour patterns + noise + random shifts."""
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[0:32, 0:32] / 32.0
  patterns = []
  for _ in range(10):
    f, phase, colour = rng.uniform(1, 4, 2), rng.uniform(0, 2 * np.pi, 2), rng.uniform(-1, 1, 3)
    wave = np.sin(2 * np.pi * f[0] * xx + phase[0]) * np.cos(2 * np.pi * f[1] * yy + phase[1])
    patterns.append(wave[..., None] * colour)
  patterns = np.stack(patterns)

  def make(n):
    labels = rng.integers(0, 10, n).astype(np.int32)
    shifts = rng.integers(-3, 4, (n, 2))
    images = np.stack([np.roll(patterns[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts)])
    images = 128 + 50 * images + rng.normal(0, 40, images.shape)
    return {"image": np.clip(images, 0, 255).astype(np.uint8), "label": labels}

  return ImageData(SYNTHETIC_NAME, make(num_train), make(num_test))


def load(source: str = "auto", data_dir=None) -> ImageData:
  """CIFAR-10 from `source`. "auto" with `data_dir`: its python batch files, else a tfds
  cifar10 prepared there, else an error naming both; never the stand-in. "auto" without:
  tfds's default folder, else the synthetic stand-in (labelled NOT CIFAR-10)."""
  if source not in SOURCES:
    raise ValueError(f"unknown CIFAR-10 source {source!r}; expected one of {SOURCES}")
  if source == "synthetic":
    return synthetic()
  if source == "files" or (source == "auto" and data_dir and any(pathlib.Path(data_dir).rglob("data_batch_1"))):
    if not data_dir:
      raise ValueError("source 'files' needs data_dir (the folder with cifar-10-batches-py)")
    return _from_files(data_dir)
  if data_dir and not pathlib.Path(data_dir).is_dir():
    raise FileNotFoundError(f"CIFAR-10 --data-dir {data_dir} is not a folder")
  try:
    return _from_tfds(data_dir)
  except Exception as err:  # not installed, offline, not prepared
    if source == "tfds" or data_dir:
      expected = "" if source == "tfds" else (f"{pathlib.Path(data_dir) / 'cifar-10-batches-py'}/"
                                              f"{{{','.join(BATCH_FILES['train'] + BATCH_FILES['test'])}}} or ")
      raise FileNotFoundError(f"no CIFAR-10 in {data_dir or 'the tensorflow-datasets folder'}: expected {expected}"
                              f"a tensorflow-datasets cifar10 prepared there ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
  return synthetic()


def normalise(images_u8: np.ndarray) -> np.ndarray:
  return ((images_u8.astype(np.float32) / 255.0) - MEAN) / STD


def augment(images_u8: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Random 32x32 crop of the 4-pixel zero-padded image, then a random horizontal flip."""
  n = len(images_u8)
  padded = np.pad(images_u8, ((0, 0), (4, 4), (4, 4), (0, 0)))
  dy, dx = rng.integers(0, 9, n), rng.integers(0, 9, n)
  rows = dy[:, None] + np.arange(32)
  cols = dx[:, None] + np.arange(32)
  out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
  flip = rng.random(n) < 0.5
  out[flip] = out[flip, :, ::-1]
  return out


def train_batches(data: ImageData, batch_size: int, seed: int, epoch: int, shards: int = 1):
  def prepare(batch, rng):
    return {**batch, "image": normalise(augment(batch["image"], rng))}
  return batching.iterate(data.train, batch_size, seed, epoch, shuffle=True, transform=prepare, shards=shards)


def eval_batches(data: ImageData, batch_size: int):
  prepare = lambda batch, rng: {**batch, "image": normalise(batch["image"])}
  return batching.iterate(data.test, batch_size, 0, 0, shuffle=False, transform=prepare)
