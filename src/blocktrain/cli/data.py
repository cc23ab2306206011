"""`blocktrain data`: fetch WikiText, or describe a corpus."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import (
    Formatter,
    add_pattern_args,
    add_progress_arg,
    file_patterns,
    print_json,
    progress_bar,
)
from blocktrain.data import ByteCorpus, fetch_wikitext, resolve_data_path
from blocktrain.data.provenance import split_rule
from blocktrain.data.sniff import gzip_cap

EXAMPLES = """examples:
  blocktrain data fetch wikitext-2 --to data/wikitext-2     # needs internet
  blocktrain data fetch wikitext-2 --to wt2 --url https://mirror/wikitext-2-raw-v1.zip#sha256=HEX
  blocktrain data info data/wikitext-2
  blocktrain data info my-notes.txt                         # one file: split 90/5/5
  blocktrain data info ~/src/project --glob '*.py' --glob '*.md' --glob '!build/**'
  blocktrain train --data ~/src/project --glob '*.py' --out runs/code  # the same patterns
  blocktrain data info hf:wikitext:wikitext-2-raw-v1        # a Hub dataset (cached, or fetched)
  blocktrain data info hf:/data/my_saved#content  # a save_to_disk folder, its column content
"""

RULES = f"""what a corpus is (--data PATH, or $BLOCKTRAIN_DATA):
  a WikiText folder   wiki.train.raw, wiki.valid.raw, wiki.test.raw at its top: each file is
                      its split (a missing one fails only when that split is asked for); the
                      folder's other files are not read
  a text file         train is the first 90% of its bytes, valid the next 5%, test the last 5%
  any other folder    every file under it, subfolders included, in path order, each split
                      90/5/5 like a file, so that every split draws from every file; windows
                      never cross from one file into the next
  hf:NAME[:CONFIG]    a Hugging Face dataset (pip install datasets): load_dataset(NAME, CONFIG)
  hf:PATH             from the Hub or its local cache (HF_DATASETS_OFFLINE=1: cache only), or a
                      local folder of data files; a folder written by save_to_disk is read with
                      load_from_disk. hf:...#FIELD names the string column read (default
                      text): each record, a newline after
                      one that lacks it. Its train, validation (or valid, dev) and test splits
                      are the splits; a dataset of one split is cut 90/5/5. The text is written
                      once to $BLOCKTRAIN_CACHE/hf/ (default ~/.cache/blocktrain/hf/), keyed by
                      the dataset's fingerprints, and data.json records name and fingerprints

which files a folder gives:
  --glob GLOB reads only the files that match, --glob '!GLOB' none that match (repeatable; a
  !GLOB wins). A glob without / is
  matched against a file's name at any depth ('*.txt'); one with / against its path from the
  folder ('src/*.py'); ** spans folders ('build/**', '**/test_*.py'). The commands that read
  data (train, eval, generate --data, worker, join, aggregator, cluster, simulate, distill) take
  them, and a run records them in data.json with the corpus. Hidden files and folders (a name
  starting with .) are never read.

what is read, judged from each file's first 64 KiB:
  UTF-8 text          as it is
  other 8-bit text    (Latin-1, Windows-1252, ...: not UTF-8, no NUL, at most 1% control bytes)
                      as its bytes, the model being byte-level, with one warning line naming the
                      files; convert them first (iconv -f latin1 -t utf-8) to train on UTF-8
  gzip text (.gz)     found by its magic bytes, decompressed into memory: at most {gzip_cap()} of
                      it per corpus (a gzip bomb is an error); gunzip a larger one to map it
  anything else       empty files, binary data, UTF-16/32 text, tar/zip/7z archives, bzip2/xz/
                      zstd files: refused, naming what the file is, when --data is that file;
                      skipped in a folder, all of them summed up in one warning line, e.g.
                      "skipped 21266 files: 21000 not text, 266 empty (first: a.bin, b.png, c.o)"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="fetch or inspect training text",
        description=__doc__,
        epilog=RULES + "\n" + EXAMPLES,
        formatter_class=Formatter,
    )
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    f = dsub.add_parser(
        "fetch",
        help="download and unpack an official WikiText archive",
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    f.add_argument("name", choices=("wikitext-2", "wikitext-103"))
    f.add_argument("--to", required=True, metavar="DIR", help="folder for the wiki.*.raw files")
    f.add_argument(
        "--url",
        metavar="URL[#sha256=HEX]",
        help="archive URL (default: the official one); a #sha256=HEX fragment is the checksum "
        "it must have (pip's spelling)",
    )
    add_progress_arg(f)
    f.set_defaults(handler=run_fetch)
    i = dsub.add_parser(
        "info",
        help="describe a corpus: its layout, splits, and the files it reads and skips",
        description="Print a corpus as JSON: its layout and split rule, each split's bytes and "
        "files, the patterns, and the files skipped (by reason) or read though not UTF-8.",
        epilog=RULES + "\n" + EXAMPLES,
        formatter_class=Formatter,
    )
    i.add_argument(
        "path", nargs="?", help="corpus path, or hf:NAME[:CONFIG] (default: $BLOCKTRAIN_DATA)"
    )
    add_pattern_args(i, of="corpus")
    i.set_defaults(handler=run_info)


def run_fetch(args: argparse.Namespace) -> int:
    bar = progress_bar(args, unit="B", unit_scale=True, desc=f"fetch {args.name}")

    def progress(done: int, total: int | None) -> None:
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    url, sha256 = _url_and_digest(args.url)
    try:
        dest = fetch_wikitext(args.name, Path(args.to), url=url, sha256=sha256, progress=progress)
    finally:
        bar.close()
    print(dest)
    return 0


def _url_and_digest(url: str | None) -> tuple[str | None, str | None]:
    """--url URL#sha256=HEX: the URL, and the digest its fragment names (None: none)."""
    if url is None or "#sha256=" not in url:
        return url, None
    source, digest = url.rsplit("#sha256=", 1)
    return source, digest.strip().lower()


def run_info(args: argparse.Namespace) -> int:
    corpus = ByteCorpus.open(resolve_data_path(args.path), file_patterns(args))
    print_json(
        {
            "path": corpus.source,
            "layout": corpus.layout,
            "split_rule": split_rule(corpus),
            "splits": corpus.describe(),
            **corpus.files(),
            **({"dataset": corpus.dataset} if corpus.dataset is not None else {}),
        }
    )
    return 0
