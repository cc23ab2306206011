"""Tests of byte corpora: layouts, splits, sampling, evaluation windows and input validation."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch

from blocktrain.data import (
    DATA_ENV,
    ByteCorpus,
    ByteSource,
    load_split,
    resolve_data_path,
)
from blocktrain.errors import DataError


def _text(n: int, seed: int, alphabet: str = "abcdefghij \n") -> bytes:
    """Deterministic pseudo-random ASCII, so windows can be located in the file."""
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n)).encode()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _rows(batch: torch.Tensor) -> list[bytes]:
    return [bytes(row.tolist()) for row in batch]


@pytest.fixture
def wikitext_dir(tmp_path: Path) -> Path:
    root = tmp_path / "wikitext"
    _write(root / "wiki.train.raw", _text(3000, 1))
    _write(root / "wiki.valid.raw", _text(500, 2))
    _write(root / "wiki.test.raw", _text(700, 3))
    _write(root / "README.txt", b"not part of any split")
    return root


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "corpus.txt", _text(2000, 4))


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    root = tmp_path / "folder"
    _write(root / "b.txt", _text(2000, 5, "abcde"))
    _write(root / "a" / "nested.txt", _text(1000, 6, "vwxyz"))
    _write(root / ".hidden.txt", b"\x00\x01 hidden and binary")
    _write(root / ".git" / "objects" / "x", b"\x00 hidden folder")
    return root


# --- layouts and splits ---------------------------------------------------------------------------


def test_wikitext_folder_maps_each_file_to_its_split(wikitext_dir: Path) -> None:
    corpus = ByteCorpus.open(wikitext_dir)
    assert corpus.layout == "wikitext"
    for name, size in (("train", 3000), ("valid", 500), ("test", 700)):
        source = corpus.split(name)
        assert isinstance(source, ByteSource)
        assert source.name == name
        assert len(source) == size
        assert source.paths == [wikitext_dir / f"wiki.{name}.raw"]
    described = corpus.describe()
    assert described["valid"] == {"bytes": 500, "files": [str(wikitext_dir / "wiki.valid.raw")]}


def test_wikitext_split_file_missing_names_file_and_folder(tmp_path: Path) -> None:
    root = tmp_path / "wt"
    _write(root / "wiki.valid.raw", _text(300, 1))
    _write(root / "wiki.test.raw", _text(300, 2))
    corpus = ByteCorpus.open(root)
    assert len(corpus.split("valid")) == 300
    with pytest.raises(DataError, match=r"wiki\.train\.raw") as info:
        corpus.split("train")
    assert str(root) in str(info.value)
    assert "train" not in corpus.describe()


def test_single_file_is_split_90_5_5_by_position(text_file: Path) -> None:
    data = text_file.read_bytes()
    corpus = ByteCorpus.open(text_file)
    assert corpus.layout == "file"
    train, valid, test = (corpus.split(n) for n in ("train", "valid", "test"))
    assert (len(train), len(valid), len(test)) == (1800, 100, 100)
    assert bytes(valid.windows(100, 100)[0].tolist()) == data[1800:1900]
    assert bytes(test.windows(100, 100)[0].tolist()) == data[1900:2000]
    assert bytes(train.windows(1800, 1800)[0].tolist()) == data[:1800]


def test_folder_splits_every_file_and_skips_hidden(text_folder: Path) -> None:
    corpus = ByteCorpus.open(text_folder)
    assert corpus.layout == "folder"
    expected = [text_folder / "a" / "nested.txt", text_folder / "b.txt"]
    for name, size in (("train", 900 + 1800), ("valid", 50 + 100), ("test", 50 + 100)):
        source = corpus.split(name)
        assert source.paths == expected
        assert len(source) == size
    valid = corpus.split("valid").windows(50, 150)
    nested, b = expected[0].read_bytes(), expected[1].read_bytes()
    assert _rows(valid) == [nested[900:950], b[1800:1850], b[1850:1900]]


def test_unknown_split_name(text_file: Path) -> None:
    with pytest.raises(DataError, match="unknown split 'dev'"):
        ByteCorpus.open(text_file).split("dev")


# --- sampling -------------------------------------------------------------------------------------


def test_sample_is_determined_by_the_generator(text_file: Path) -> None:
    source = ByteCorpus.open(text_file).split("train")
    first = source.sample(8, 32, torch.Generator().manual_seed(123))
    again = source.sample(8, 32, torch.Generator().manual_seed(123))
    other = source.sample(8, 32, torch.Generator().manual_seed(124))
    assert first.shape == (8, 32)
    assert first.dtype == torch.int64
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_sample_windows_are_real_bytes_of_the_split(text_file: Path) -> None:
    train_bytes = text_file.read_bytes()[:1800]
    source = ByteCorpus.open(text_file).split("train")
    batch = source.sample(64, 40, torch.Generator().manual_seed(0))
    assert int(batch.min()) >= 0 and int(batch.max()) < 256
    for row in _rows(batch):
        assert row in train_bytes


def test_sample_never_straddles_files(text_folder: Path) -> None:
    # nested.txt uses only v-z, b.txt only a-e: a straddling window would mix both alphabets.
    files = [text_folder / "a" / "nested.txt", text_folder / "b.txt"]
    trains = [f.read_bytes()[: len(f.read_bytes()) * 9 // 10] for f in files]
    source = ByteCorpus.open(text_folder).split("train")
    for row in _rows(source.sample(200, 64, torch.Generator().manual_seed(1))):
        assert any(row in train for train in trains)


def test_sample_picks_files_in_proportion_to_valid_starts(tmp_path: Path) -> None:
    root = tmp_path / "two"
    _write(root / "small.txt", _text(1000, 1, "ab"))  # train 900 bytes -> 891 starts at T=10
    _write(root / "large.txt", _text(3000, 2, "xy"))  # train 2700 bytes -> 2691 starts
    source = ByteCorpus.open(root).split("train")
    batch = source.sample(4000, 10, torch.Generator().manual_seed(7))
    share_small = float((batch[:, 0] <= ord("b")).float().mean())
    assert abs(share_small - 891 / (891 + 2691)) < 0.03


def test_sample_skips_files_shorter_than_seq_len(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    _write(root / "short.txt", b"zzzzzzzzzz" * 3)  # 27 train bytes
    _write(root / "long.txt", _text(2000, 3, "abc"))
    source = ByteCorpus.open(root).split("train")
    batch = source.sample(100, 64, torch.Generator().manual_seed(0))
    assert int(batch.max()) <= ord("c")


def test_split_shorter_than_seq_len_fails_helpfully(text_file: Path) -> None:
    valid = ByteCorpus.open(text_file).split("valid")  # 100 bytes
    with pytest.raises(DataError, match="valid split is shorter than seq_len = 128 bytes"):
        valid.sample(4, 128, torch.Generator().manual_seed(0))
    with pytest.raises(DataError, match="shorter than seq_len"):
        valid.windows(128, 1024)
    assert valid.sample(2, 100, torch.Generator()).shape == (2, 100)


def test_a_copied_source_maps_the_files_again(text_folder: Path) -> None:
    # Sending a source to a worker process must not serialise the corpus bytes themselves.
    source = ByteCorpus.open(text_folder).split("train")
    assert "_arrays" not in source.__getstate__()
    clone = copy.deepcopy(source)
    assert clone.paths == source.paths and len(clone) == len(source)
    seed = 5
    expected = source.sample(4, 16, torch.Generator().manual_seed(seed))
    assert torch.equal(clone.sample(4, 16, torch.Generator().manual_seed(seed)), expected)


# --- evaluation windows ---------------------------------------------------------------------------


def test_windows_are_deterministic_consecutive_and_capped(text_file: Path) -> None:
    data = text_file.read_bytes()
    train = ByteCorpus.open(text_file).split("train")  # 1800 bytes
    first = train.windows(64, 300)
    assert first.shape == (5, 64)  # ceil(300 / 64)
    assert first.dtype == torch.int64
    assert torch.equal(first, train.windows(64, 300))
    assert b"".join(_rows(first)) == data[: 5 * 64]
    capped = train.windows(64, 10**9)
    assert capped.shape == (1800 // 64, 64)
    assert b"".join(_rows(capped)) == data[: (1800 // 64) * 64]


def test_windows_continue_file_by_file(text_folder: Path) -> None:
    nested = (text_folder / "a" / "nested.txt").read_bytes()
    b = (text_folder / "b.txt").read_bytes()
    train = ByteCorpus.open(text_folder).split("train")  # 900 then 1800 bytes
    rows = _rows(train.windows(400, 10**9))
    assert rows == [nested[:400], nested[400:800], *(b[i : i + 400] for i in range(0, 1600, 400))]


# --- paths and validation -------------------------------------------------------------------------


def test_resolve_prefers_flag_then_env(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert resolve_data_path(text_file) == text_file
    assert resolve_data_path(str(text_file)) == text_file
    assert resolve_data_path(None) == tmp_path


def test_resolve_without_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(DataError, match="no data given: pass --data PATH or set BLOCKTRAIN_DATA"):
        resolve_data_path(None)
    monkeypatch.setenv(DATA_ENV, "")
    with pytest.raises(DataError, match="no data given"):
        resolve_data_path("")


def test_missing_path_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"nope\.txt"):
        resolve_data_path(missing)
    with pytest.raises(DataError, match="does not exist"):
        ByteCorpus.open(missing)
    monkeypatch.setenv(DATA_ENV, str(missing))
    with pytest.raises(DataError, match=r"nope\.txt"):
        load_split(None, "train")


def test_load_split_uses_env(text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV, str(text_file))
    assert len(load_split(None, "test")) == 100


def test_empty_file(tmp_path: Path) -> None:
    empty = _write(tmp_path / "empty.txt", b"")
    with pytest.raises(DataError, match=r"empty\.txt is empty"):
        ByteCorpus.open(empty)


def test_empty_folder(tmp_path: Path) -> None:
    root = tmp_path / "nothing"
    _write(root / "zero.txt", b"")
    _write(root / ".hidden", b"text but hidden")
    with pytest.raises(DataError, match="is empty"):
        ByteCorpus.open(root)


def test_empty_wikitext_split_file(tmp_path: Path) -> None:
    _write(tmp_path / "wiki.train.raw", b"")
    with pytest.raises(DataError, match=r"wiki\.train\.raw is empty"):
        ByteCorpus.open(tmp_path)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"hello\x00world" * 10, id="nul-bytes"),
        pytest.param(random.Random(0).randbytes(4096), id="random"),
        pytest.param(b"caf\xe9\x01\x02\x03 not UTF-8, many control bytes" * 10, id="controls"),
    ],
)
def test_binary_file_is_rejected(tmp_path: Path, payload: bytes) -> None:
    blob = _write(tmp_path / "blob.bin", payload)
    with pytest.raises(DataError, match=r"does not look like text.*BlockTrain reads UTF-8 text"):
        ByteCorpus.open(blob)


def test_folder_of_only_binary_files_is_one_error(tmp_path: Path) -> None:
    root = tmp_path / "bins"
    _write(root / "a.bin", b"\x00" * 100)
    _write(root / "b.bin", bytes(range(256)))
    _write(root / "c.txt", b"")
    with pytest.raises(DataError, match=r"folder .*bins does not look like text \(binary data\)"):
        ByteCorpus.open(root)


def test_folder_skips_binary_files_next_to_text(tmp_path: Path) -> None:
    root = tmp_path / "mix"
    text = _write(root / "good.txt", _text(500, 9))
    _write(root / "model.bin", b"\x00\xff" * 100)
    assert ByteCorpus.open(root).split("train").paths == [text]


def test_utf8_character_cut_by_the_sniff_window_is_text(tmp_path: Path) -> None:
    # Byte 65535 is the first byte of a two-byte character, so the 64 KiB sample ends mid-character.
    data = b"a" + "é".encode() * 40000
    assert data[65535:65537] == "é".encode()
    corpus = ByteCorpus.open(_write(tmp_path / "accents.txt", data))
    assert len(corpus.split("train")) == int(len(data) * 0.9)


# --- the real corpus ------------------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get(DATA_ENV), reason=f"{DATA_ENV} is not set")
def test_real_corpus_opens_with_non_empty_splits() -> None:
    corpus = ByteCorpus.open(resolve_data_path(None))
    described = corpus.describe()
    assert set(described) == {"train", "valid", "test"}
    for name in ("train", "valid", "test"):
        source = corpus.split(name)
        assert len(source) > 0
        assert source.sample(2, 16, torch.Generator().manual_seed(0)).shape == (2, 16)
