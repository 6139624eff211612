"""Build the fine-tuning corpus that hf_hybrid ships: English docstrings of the `transformers` package (Apache-2.0).

    python scripts/build_docs_corpus.py        # writes hf_hybrid/assets/transformers-docs/{train,validation}.txt.gz

The benchmark's fine-tuning regimes pretrain a GPT-2 on the shipped Shakespeare and fine-tune it on this: a real
change of domain (Elizabethan verse to technical English with code examples), as in most Trainer fine-tuning jobs.
Paragraphs are de-duplicated (the library repeats its argument docs in every model), kept in file order, and split by
module, so no validation module is seen in training. Only `transformers` is read: the Python standard library's
source stays out of every corpus here, as an outside check.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "hf_hybrid" / "assets" / "transformers-docs"
MIN_PARAGRAPH_CHARS = 80
VALIDATION_SHARE = 20  # one module in 20 (by a hash of its path) goes to validation


def docstring_paragraphs(source: str) -> list[str]:
    tree = ast.parse(source)
    paragraphs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                paragraphs += [p.strip() for p in doc.split("\n\n") if len(p.strip()) >= MIN_PARAGRAPH_CHARS]
    return paragraphs


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_chars", type=int, default=2_500_000)
    parser.add_argument("--validation_chars", type=int, default=250_000)
    args = parser.parse_args()
    root = Path(transformers.__file__).parent
    seen: set[str] = set()
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    sizes = {"train": 0, "validation": 0}
    limits = {"train": args.train_chars, "validation": args.validation_chars}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        held_out = int(hashlib.sha1(relative.encode()).hexdigest(), 16) % VALIDATION_SHARE == 0
        split = "validation" if held_out else "train"
        if sizes[split] >= limits[split]:
            continue
        try:
            paragraphs = docstring_paragraphs(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for paragraph in paragraphs:
            if paragraph not in seen:
                seen.add(paragraph)
                splits[split].append(paragraph)
                sizes[split] += len(paragraph)
    ASSET_DIR.mkdir(parents=True, exist_ok=True)
    for split, paragraphs in splits.items():
        # mtime=0: the same input gives byte-identical files.
        with open(ASSET_DIR / f"{split}.txt.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(("\n\n".join(paragraphs) + "\n").encode())
    (ASSET_DIR / "SOURCE.txt").write_text(
        f"Docstrings of transformers {transformers.__version__} (https://github.com/huggingface/transformers),\n"
        "copyright The Hugging Face team and the authors of each file, licensed under the Apache License 2.0\n"
        "(https://www.apache.org/licenses/LICENSE-2.0). Extracted and de-duplicated by scripts/build_docs_corpus.py;\n"
        "no other change.\n")
    print({split: f"{sizes[split]} chars" for split in sizes}, "->", ASSET_DIR)


if __name__ == "__main__":
    main()
