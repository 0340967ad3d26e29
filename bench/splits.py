"""`python -m bench.splits`: which files form each split of the development text
(cache/retention/text_splits.py), their sizes, and `--write DIR` writes them for `--text-file`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cache.retention.text_splits import CORPORA, PARTS, split_file, split_files, split_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", type=Path, default=None, help="write every split into this folder")
    p.add_argument("--tokens", action="store_true", help="count tokens (default model)")
    args = p.parse_args(argv)
    tokenizer = None
    if args.tokens:
        from models.loading import load_model

        tokenizer = load_model("default")[1]
    for corpus in CORPORA:
        for part in PARTS:
            files = split_files(corpus, part)
            text = split_text(corpus, part)
            count = f", {len(tokenizer.encode(text))} tokens" if tokenizer else ""
            where = f" -> {split_file(corpus, part, args.write)}" if args.write else ""
            print(f"{corpus}/{part}: {len(files)} files, {len(text)} chars{count}{where}")
            print("  " + " ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
