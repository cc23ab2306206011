"""Which files a corpus reads: --glob patterns (GLOB, !GLOB), the one-line summary of skipped
files, text in other 8-bit encodings, gzip-compressed text (and its cap), and files named for
what they are (UTF-16, archives, other compressed formats)."""

from __future__ import annotations

import bz2
import copy
import gzip
import io
import json
import logging
import pickle
import tarfile
from pathlib import Path

import pytest

from blocktrain.data import ByteCorpus, FilePatterns, load_split, sniff
from blocktrain.data.provenance import check_data, corpus_record, write_record
from blocktrain.errors import DataError

TEXT = b"The quick brown fox jumps over the lazy dog.\n" * 40
LATIN1 = "Café, crème brûlée, Noël et déjà vu.\n".encode("latin-1") * 30


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _read_all(corpus: ByteCorpus) -> bytes:
    return b"".join(bytes(corpus.split(s).read()) for s in ("train", "valid", "test"))


def _names(corpus: ByteCorpus, root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in corpus.split("train").paths]


def _corpus_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "blocktrain.data.corpus" and r.levelno == logging.WARNING
    ]


# --- patterns -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "selected"),
    [
        ("*.txt", "a.txt", True),
        ("*.txt", "deep/down/a.txt", True),  # no "/": a name at any depth
        ("*.txt", "a.txt.bak", False),
        ("src/*.py", "src/a.py", True),
        ("src/*.py", "src/sub/a.py", False),  # * stays within a folder's name
        ("src/*.py", "lib/src/a.py", False),  # a "/" anchors at the folder
        ("/src/*.py", "src/a.py", True),
        ("src/**/*.py", "src/a.py", True),  # ** spans zero or more folders
        ("src/**/*.py", "src/x/y/a.py", True),
        ("build/**", "build/out/x.o", True),
        ("build/**", "rebuild/x.o", False),
        ("build/", "build/x.o", True),  # a trailing / means everything under it
        ("**/test_*.py", "test_a.py", True),
        ("**/test_*.py", "pkg/tests/test_a.py", True),
        ("data?.csv", "data1.csv", True),
        ("data?.csv", "data12.csv", False),
        ("[ab].md", "a.md", True),
        ("[!ab].md", "c.md", True),
        ("[!ab].md", "a.md", False),
        ("a+b(1).txt", "a+b(1).txt", True),  # regular-expression characters are literal
    ],
)
def test_a_pattern_matches_names_anywhere_and_paths_from_the_folder(
    pattern: str, path: str, selected: bool
) -> None:
    assert FilePatterns(include=(pattern,)).selects(path) is selected
    assert FilePatterns(exclude=(pattern,)).selects(path) is not selected


def test_exclude_wins_over_include_and_no_pattern_reads_everything() -> None:
    both = FilePatterns(include=("*.py",), exclude=("build/**",))
    assert both.selects("src/a.py") and not both.selects("build/a.py")
    assert not both.selects("README.md")
    assert FilePatterns().selects("anything/at/all.bin")
    assert both.argv() == ["--glob", "*.py", "--glob", "!build/**"]
    assert both.flags() == "--glob '*.py' --glob '!build/**'"


def test_an_empty_pattern_is_one_clear_error() -> None:
    with pytest.raises(DataError, match="--glob takes a non-empty glob"):
        FilePatterns(exclude=(" ",))


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    """A project folder: code, docs, build outputs and binaries, as a researcher's would be."""
    root = tmp_path / "project"
    _write(root / "src" / "main.py", b"print('hello')\n" * 50)
    _write(root / "src" / "pkg" / "util.py", b"def f():\n    return 1\n" * 50)
    _write(root / "docs" / "guide.md", b"# Guide\n\nRead me.\n" * 50)
    _write(root / "build" / "gen.py", b"# generated\n" * 50)
    _write(root / "build" / "main.o", b"\x7fELF\x00\x00" * 100)
    _write(root / "logo.png", b"\x89PNG\r\n\x1a\n\x00\x00" * 50)
    _write(root / "empty.txt", b"")
    _write(root / ".git" / "config", b"[core]\n")
    return root


def test_include_and_exclude_choose_the_files_of_a_folder(source_tree: Path) -> None:
    patterns = FilePatterns(include=("*.py", "*.md"), exclude=("build/**",))
    corpus = ByteCorpus.open(source_tree, patterns)
    assert _names(corpus, source_tree) == ["docs/guide.md", "src/main.py", "src/pkg/util.py"]
    assert corpus.excluded == 4, "build/gen.py, build/main.o, logo.png, empty.txt (.git: hidden)"
    assert corpus.skipped == {}, "the patterns left out the binaries: nothing to skip"
    only_src = load_split(source_tree, "valid", FilePatterns(include=("src/**",)))
    assert [p.name for p in only_src.paths] == ["main.py", "util.py"]


def test_patterns_that_choose_nothing_say_so(source_tree: Path) -> None:
    with pytest.raises(DataError, match=r"no file of folder .*project is chosen by --glob "):
        ByteCorpus.open(source_tree, FilePatterns(include=("*.rs",)))


def test_patterns_with_a_single_file_are_refused(tmp_path: Path) -> None:
    file = _write(tmp_path / "notes.txt", TEXT)
    with pytest.raises(DataError, match=r"--glob '\*\.md' choose files of a folder"):
        ByteCorpus.open(file, FilePatterns(include=("*.md",)))


def test_patterns_decide_whether_a_folder_is_read_as_wikitext(tmp_path: Path) -> None:
    root = tmp_path / "wt"
    _write(root / "wiki.train.raw", TEXT)
    _write(root / "notes.txt", TEXT[:500])
    assert ByteCorpus.open(root).layout == "wikitext"
    plain = ByteCorpus.open(root, FilePatterns(exclude=("wiki.*.raw",)))
    assert plain.layout == "folder" and _names(plain, root) == ["notes.txt"]


# --- skipped files: one line ------------------------------------------------------------------------


def test_skipped_files_are_one_warning_line_with_counts(
    source_tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="blocktrain.data.corpus")
    for i in range(40):
        _write(source_tree / "objs" / f"o{i:02}.bin", b"\x00\x01\x02" * 30)
    corpus = ByteCorpus.open(source_tree)
    load_split(source_tree, "valid")  # the same corpus again, as train opens it for each split
    lines = _corpus_warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "skipped 43 files: 42 not text, 1 empty (first: build/main.o, empty.txt, logo.png)"
    )
    assert corpus.files()["skipped"] == {"not text": 42, "empty": 1}
    assert _names(corpus, source_tree) == [
        "build/gen.py",
        "docs/guide.md",
        "src/main.py",
        "src/pkg/util.py",
    ]


def test_a_folder_with_nothing_to_read_names_what_it_skipped(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    _write(root / "a.bin", b"\x00" * 10)
    _write(root / "b.zip", b"PK\x03\x04" + b"\x00" * 10)
    with pytest.raises(DataError, match=r"skipped 2 files: 1 not text, 1 archives \(first: a\.bin"):
        ByteCorpus.open(root)


# --- encodings ------------------------------------------------------------------------------------


def test_latin1_text_is_read_as_its_bytes_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="blocktrain.data.corpus")
    file = _write(tmp_path / "old.txt", LATIN1)
    corpus = ByteCorpus.open(file)
    assert _read_all(corpus) == LATIN1, "every byte, unchanged"
    assert corpus.not_utf8 == ["old.txt"]
    (line,) = _corpus_warnings(caplog)
    assert "read 1 file that is not UTF-8 as its bytes (8-bit text such as Latin-1" in line


def test_a_folder_reads_latin1_files_beside_utf8_ones(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    _write(root / "new.txt", "naïve UTF-8 text\n".encode() * 30)
    _write(root / "old.txt", LATIN1)
    corpus = ByteCorpus.open(root)
    assert _names(corpus, root) == ["new.txt", "old.txt"] and corpus.not_utf8 == ["old.txt"]
    assert corpus.skipped == {}


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        pytest.param(
            "UTF-16 text".encode("utf-16"),
            r"is UTF-16 or UTF-32 text .*iconv -f UTF-16 -t UTF-8 x\.dat",
            id="utf16",
        ),
        pytest.param(
            bz2.compress(TEXT), r"is bzip2-compressed \(unpack it: `bunzip2 x\.dat`", id="bz2"
        ),
        pytest.param(b"\xfd7zXZ\x00" + b"\x00" * 20, "is xz-compressed", id="xz"),
        pytest.param(b"PK\x03\x04" + b"\x00" * 20, "is a zip archive", id="zip"),
    ],
)
def test_a_file_that_is_not_read_is_named_for_what_it_is(
    tmp_path: Path, payload: bytes, match: str
) -> None:
    with pytest.raises(DataError, match=match):
        ByteCorpus.open(_write(tmp_path / "x.dat", payload))


def test_a_tar_archive_is_named(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = len(TEXT)
        tar.addfile(info, io.BytesIO(TEXT))
    with pytest.raises(DataError, match=r"is a tar archive \(unpack it: `tar -xf x\.tar`"):
        ByteCorpus.open(_write(tmp_path / "x.tar", buf.getvalue()))
    tgz = _write(tmp_path / "x.tar.gz", gzip.compress(buf.getvalue()))
    with pytest.raises(DataError, match="is gzip-compressed: a tar archive"):
        ByteCorpus.open(tgz)


# --- gzip -----------------------------------------------------------------------------------------


def test_gzip_text_is_read_decompressed_and_split_by_its_text(tmp_path: Path) -> None:
    plain = ByteCorpus.open(_write(tmp_path / "plain" / "a.txt", TEXT))
    packed = ByteCorpus.open(_write(tmp_path / "packed" / "a.txt.gz", gzip.compress(TEXT)))
    assert _read_all(packed) == TEXT
    for split in ("train", "valid", "test"):
        assert len(packed.split(split)) == len(plain.split(split))
        assert packed.split(split).sha256() == plain.split(split).sha256(), "same text, same hash"


def test_a_gzip_split_travels_to_another_process(tmp_path: Path) -> None:
    source = load_split(_write(tmp_path / "a.gz", gzip.compress(TEXT)), "train")
    again = pickle.loads(pickle.dumps(source))
    assert bytes(again.read()) == bytes(source.read()) == TEXT[: int(len(TEXT) * 0.9)]
    assert bytes(copy.deepcopy(source).read()) == bytes(source.read())


def test_a_folder_reads_gzip_and_plain_files_and_skips_gzip_binaries(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    _write(root / "a.log", TEXT)
    _write(root / "b.log.gz", gzip.compress(TEXT[::-1]))
    _write(root / "c.bin.gz", gzip.compress(b"\x00\x01" * 100))
    corpus = ByteCorpus.open(root)
    assert _names(corpus, root) == ["a.log", "b.log.gz"]
    assert corpus.skipped == {"not text": ["c.bin.gz"]}


def test_a_corrupt_gzip_file_is_a_clear_error(tmp_path: Path) -> None:
    cut = _write(tmp_path / "cut.gz", gzip.compress(TEXT * 50)[:200])
    with pytest.raises(DataError, match=r"cut\.gz is not a valid gzip file"):
        ByteCorpus.open(cut)


def test_gzip_text_past_the_cap_is_an_error_not_an_out_of_memory_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sniff, "GZIP_MAX_BYTES", 4096)
    bomb = _write(tmp_path / "bomb.gz", gzip.compress(b"a" * 100_000))
    assert bomb.stat().st_size < 1000
    with pytest.raises(DataError, match=r"bomb\.gz decompresses to more than the 4 KiB"):
        ByteCorpus.open(bomb)
    root = tmp_path / "many"  # the cap holds for the corpus, not per file
    for name in ("a", "b", "c"):
        _write(root / f"{name}.gz", gzip.compress(TEXT[:1500]))
    with pytest.raises(DataError, match=r"c\.gz decompresses to more than"):
        ByteCorpus.open(root)
    assert ByteCorpus.open(root, FilePatterns(exclude=("c.gz",))).split("train").paths


# --- the run's record -------------------------------------------------------------------------------


def test_a_run_records_its_patterns_and_a_check_names_them(
    source_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patterns = FilePatterns(include=("*.py",), exclude=("build/**",))
    record = corpus_record(source_tree, patterns=patterns)
    assert record["include"] == ["*.py"] and record["exclude"] == ["build/**"]
    assert [Path(f).name for f in record["splits"]["train"]["files"]] == ["main.py", "util.py"]
    run = tmp_path / "run"
    run.mkdir()
    write_record(run, record)
    assert json.loads((run / "data.json").read_text())["include"] == ["*.py"]
    same = check_data(run, source_tree, ("train",), patterns)
    assert same["same_as_training"] is True and capsys.readouterr().err == ""
    other = check_data(run, source_tree, ("train",))
    assert other["same_as_training"] is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("blocktrain: warning:")
    assert "it was trained with --glob '*.py' --glob '!build/**' (given now: none)" in err
