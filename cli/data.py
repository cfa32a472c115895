"""``meridian data``: turn text and JSON-lines files into a prepared token dataset a job can name.

``prepare`` tokenises on this machine (:mod:`meridian.workers.data.prepare`) and prints the manifest's
figures; ``--json`` prints one JSON object, or ``{"error": PROBLEM}`` on bad input (its ``file`` names the
file). Bad input exits 2 with the message (naming the file) on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meridian.cli.errors import local_problem, report


def add_data_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare token datasets for jobs (`\"data\": {\"dataset\": DIR}`)",
                          description="prepare token datasets for jobs")
    dsub = data.add_subparsers(dest="data_verb", required=True, metavar="ACTION")
    pr = dsub.add_parser(
        "prepare", help="tokenise text / JSON-lines files into memory-mapped token shards",
        description="tokenise UTF-8 text files (a document per paragraph) and JSON-lines files (a document per "
                    "line's text field) into memory-mapped token shards, a document index, the tokenizer and a "
                    "manifest; a rerun on the same inputs and options reuses the result")  # fmt: skip
    pr.add_argument("inputs", nargs="+", metavar="INPUT", help="text or .jsonl files")
    pr.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to write")
    tok = pr.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json to use as it is")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the inputs")
    pr.add_argument("--vocab-size", type=int, default=0, help="vocabulary of the trained BPE (with --train-tokenizer)")
    pr.add_argument("--val-fraction", type=float, default=0.05,
                    help="fraction of the documents held out for validation (default 0.05)")
    pr.add_argument("--text-field", default="text", help="field of a JSON line holding its text (default: text)")
    pr.add_argument("--max-vocab", type=int, default=0, metavar="N",
                    help="fail if the tokenizer has more than N tokens (the model's vocab_size)")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.add_argument("--json", action="store_true", help="machine-readable output")
    pr.set_defaults(run=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from meridian.workers.data.prepare import PrepareOptions, prepare

    if args.train_tokenizer and not args.vocab_size:
        raise ValueError("--train-tokenizer needs --vocab-size N")
    opts = PrepareOptions(tokenizer=args.tokenizer or "", train_tokenizer=args.train_tokenizer,
                          vocab_size=args.vocab_size, val_fraction=args.val_fraction, text_field=args.text_field,
                          max_vocab=args.max_vocab)
    log = None if args.json else (lambda msg: print(msg, file=sys.stderr))
    r = prepare(args.inputs, args.out, opts, progress=not args.quiet, log=log)
    d = r.to_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        how = "reused (same inputs and options)" if r.reused else f"written in {d['seconds']:.1f} s"
        print(f"{d['directory']}: {how}\n  {d['tokens']:,} tokens ({d['train_tokens']:,} train, {d['val_tokens']:,} "
              f"validation) in {d['documents']:,} documents, vocabulary {d['vocab_size']} ({d['dtype']})\n"
              f"  use it: \"data\": {{\"dataset\": \"{d['directory']}\"}} and model.vocab_size >= {d['vocab_size']}")
    return 0


def run(args: argparse.Namespace) -> int:
    from meridian.workers.data.prepare import PrepareError

    try:
        return args.run(args)
    except (PrepareError, ValueError) as e:
        problem = local_problem("invalid-data", "Invalid data", str(e), file=getattr(e, "path", ""))
        return report(bool(getattr(args, "json", False)), problem, 2)
