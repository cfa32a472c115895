"""``meridian export``: a job's final (or latest) checkpoint as a directory of the model's own family (the
conversion is :mod:`meridian.workers.model.export`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from meridian.api.client import Client
from meridian.cli.errors import CliError


def _check_readable_here(info: dict) -> None:
    """A local path: the service says whether it is readable (this runs where it is mounted); a URL: this
    process reads it with its own environment's credentials."""
    from meridian.workers.state import storage

    latest = info["latest"]
    if not storage.is_url(latest):
        if not info["readable_here"]:
            raise CliError("checkpoint-unreadable", "Checkpoint unreadable here",
                           f"{latest} is not readable from this machine: run `meridian export` where the "
                           "service's storage is mounted")
        return
    try:
        storage.check_url(latest)
        if not any(storage.exists(storage.join(latest, marker)) for marker in storage.MARKERS):
            raise FileNotFoundError(f"{latest} holds no complete checkpoint")
    except Exception as e:  # the filesystem library's own errors (credentials, endpoint) too
        raise CliError("checkpoint-unreadable", "Checkpoint unreadable here",
                       f"cannot read {latest} from here ({type(e).__name__}: {e}); set the credentials and endpoint "
                       "in this shell's environment (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                       "AWS_ENDPOINT_URL)") from e


def cmd_export(args: argparse.Namespace, client: Client) -> int:
    """Convert a job's final (or latest) checkpoint into a Hugging Face directory. The checkpoint is read from
    the path or URL the artifacts endpoint gives, so this runs where the service's storage is readable (its
    machine, or a node sharing it; for a URL, wherever its credentials are)."""
    if not args.max_shard_mb > 0:
        raise ValueError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    info = client.artifacts(args.id)
    if info["latest"] is None:
        why = "it opted out (checkpoint.keep_final: false)" if not info["keep_final"] else "it has not finished yet"
        raise CliError("no-checkpoint", "No checkpoint", f"job {args.id} has no checkpoint in {info['storage']}: {why}")
    _check_readable_here(info)
    from meridian.workers.model.export import export_job  # torch: only this verb needs it

    latest = next(a for a in info["artifacts"] if a["path"] == info["latest"])
    try:
        done = export_job(info["latest"], info["model"], info["data"], args.out, dtype=args.dtype,
                          max_shard_bytes=int(args.max_shard_mb * 1e6))
    except Exception as e:
        if type(e) is not Exception:  # only `tokenizers`' own (a bare Exception): any other is a bug to show
            raise
        raise CliError("tokenizer-unreadable", "Tokenizer unreadable",
                       f"the weights are in {args.out}, but its tokenizer.json, copied from job {args.id}'s dataset, "
                       f"is not one the tokenizers library can read ({e}); delete it from {args.out} (the dataset's "
                       "tokenizer.json was damaged since it was prepared: prepare the text again to get one)") from None
    out, tokenizer = done["out"], done["tokenizer"]
    note = "" if latest["final"] else " (not the final step: the job has not finished)"
    if args.json:
        print(json.dumps({"out": out, "step": latest["step"], "final": latest["final"], "weights": done["weights"],
                          "tokenizer": tokenizer}))
    else:
        loader = ("transformers.AutoModelForCausalLM.from_pretrained" if info["model"].get("family") != "factory"
                  else "your factory's module and safetensors.torch.load_file")
        print(f"wrote {out} from step {latest['step']}{note} ({', '.join(done['weights'])}); load it with "
              f"{loader}({out!r})")
        print(f"tokenizer: {', '.join(tokenizer['files'])} from {tokenizer['source']}; load it with "
              f"transformers.AutoTokenizer.from_pretrained({out!r})" if tokenizer["written"]
              else f"no tokenizer written: {tokenizer['reason']}")
    return 0


def add_export_parser(verb: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``export`` (``verb`` makes a remote verb's parser: ``--json``, ``--url``)."""
    s = verb("export", "write a job's final weights, its configs and its dataset's tokenizer as a directory of the "
                       "model's own family (Hugging Face)")
    s.add_argument("id")
    s.add_argument("--out", required=True, help="directory to write")
    s.add_argument("--format", choices=["hf"], default="hf", help="hf: what AutoModelForCausalLM loads")
    s.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="precision of the weights written (default: the checkpoint's, what training kept)")
    s.add_argument("--max-shard-mb", type=float, default=5000.0, metavar="MB",
                   help="largest safetensors shard in MB (default 5000); more weights go in more shards, with "
                        "model.safetensors.index.json")
    s.set_defaults(run=cmd_export)
