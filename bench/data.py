"""``meridian bench data``: does a worker's memory stay flat as the dataset grows, and how fast is prepare?

Command: ``meridian bench data --json`` (defaults: 20 MB and 2 GB synthetic uint16 token datasets, 40
steps of the ``nano`` model on each, global batch 16).

1. Write each synthetic dataset directly as uint16 shards plus a manifest (random tokens, so no time is
   spent tokenising), in a temporary directory removed afterwards.
2. For each, a fresh spawned process trains on it as a worker does: :func:`make_dataset` over the memory-
   mapped shards, :meth:`step_batches` of a step, forward, backward and an AdamW step of a small GPT. It
   reports its peak resident set (``ru_maxrss``) and the RSS before the first batch.
3. Time ``data prepare`` on the Python Language Reference (``pydoc_data.topics``) repeated to ``--prepare-mb``:
   once training a byte-level BPE (``--vocab-size``), once with that tokenizer given (tokenising only).

Goal: the peak RSS of the two workers differs by less than 100 MB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

NAME = "data"
HELP = "worker peak RSS on a 20 MB vs a 2 GB token dataset, and data prepare tokens/s"
GOAL_MB = 100.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mb", default="20,2048", help="synthetic dataset sizes in MB (default 20,2048)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096, help="token ids of the synthetic data (and the model)")
    p.add_argument("--prepare-mb", type=float, default=8.0, help="text to tokenise for the prepare timing")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE trained for the prepare timing")
    p.add_argument("--dir", default="", help="where to write the datasets (default: a temporary directory)")


def write_synthetic(directory: str, tokens: int, vocab: int, seed: int = 0) -> None:
    """A prepared dataset of ``tokens`` random uint16 ids (1 % of them validation), written in 64 MiB chunks."""
    import numpy as np

    from meridian.workers.data.manifest import Manifest, Shard, Split, write_manifest

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, vocab, size=min(tokens, 1 << 25), dtype=np.uint16)
    val = max(1024, tokens // 100)
    splits = {}
    for name, count in (("train", tokens - val), ("val", val)):
        fname = f"{name}-00000.bin"
        with open(os.path.join(directory, fname), "wb") as f:
            left = count
            while left:
                part = chunk[: min(left, len(chunk))]
                part.tofile(f)
                left -= len(part)
        splits[name] = Split(tokens=count, documents=1, shards=(Shard(fname, count),))
    write_manifest(directory, Manifest(key=f"synthetic-{tokens}", vocab_size=vocab, dtype="uint16",
                                       tokenizer_sha256="", tokenizer_trained=False, eos_id=None, text_field="text",
                                       val_fraction=0.01, train=splits["train"], val=splits["val"]))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _worker(directory: str, steps: int, global_batch: int, seq_len: int, vocab: int, q: Any) -> None:
    import resource

    import torch

    from meridian.workers.contracts.config import DataConfig
    from meridian.workers.contracts.model_config import ModelConfig
    from meridian.workers.data.shards import make_dataset
    from meridian.workers.model.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=seq_len, vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_dataset(DataConfig(dataset=directory), seq_len, seed=0)
    before = _rss_kib()
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for step in range(steps):
        for x, y in data.step_batches(step, global_batch, global_batch, 0, 1):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            loss = loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
    q.put({"rss_before_data_mb": before / 1024, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "rss_end_mb": _rss_kib() / 1024, "samples": data.num_samples, "steps_per_s": steps / (time.perf_counter() - t0),
           "final_loss": loss.item()})


def _measure(directory: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(directory, args.steps, args.global_batch, args.seq_len, args.vocab, q))
    p.start()
    out = q.get(timeout=600)
    p.join()
    return out


def _prepare_timing(work: str, args: argparse.Namespace) -> dict[str, Any]:
    from pydoc_data.topics import topics

    from meridian.workers.data.prepare import PrepareOptions, prepare

    text = "\n\n".join(topics[k] for k in sorted(topics))
    reps = max(1, int(args.prepare_mb * 1e6 / len(text.encode("utf-8"))))
    path = os.path.join(work, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(reps):
            f.write(text + "\n\n")
    size = os.path.getsize(path)
    trained = prepare([path], os.path.join(work, "prep-trained"),
                      PrepareOptions(train_tokenizer=True, vocab_size=args.vocab_size), progress=False)
    given = prepare([path], os.path.join(work, "prep-given"),
                    PrepareOptions(tokenizer=os.path.join(work, "prep-trained", "tokenizer.json")), progress=False)
    return {"input_mb": size / 1e6, "tokens": given.manifest.tokens, "cpus": os.cpu_count(),
            "train_bpe_and_tokenise_s": trained.seconds, "tokenise_s": given.seconds,
            "tokens_per_s": given.tokens_per_s, "mb_per_s": size / 1e6 / given.seconds,
            "with_bpe_training_tokens_per_s": trained.tokens_per_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.dir or tempfile.mkdtemp(prefix="meridian-bench-data-")
    try:
        datasets = []
        for mb in (float(s) for s in args.sizes_mb.split(",")):
            d = os.path.join(work, f"synthetic-{mb:g}mb")
            t0 = time.perf_counter()
            write_synthetic(d, int(mb * 1e6) // 2, args.vocab)
            written = time.perf_counter() - t0
            datasets.append({"size_mb": mb, "write_s": written, **_measure(d, args)})
            shutil.rmtree(d)
        peaks = [d["peak_rss_mb"] for d in datasets]
        diff = max(peaks) - min(peaks)
        return {"datasets": datasets, "peak_rss_diff_mb": diff, "goal_mb": GOAL_MB, "goal_met": diff < GOAL_MB,
                "prepare": _prepare_timing(work, args)}
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def render(result: dict[str, Any]) -> str:
    lines = [f"{'dataset':>10} {'RSS before data':>15} {'peak RSS':>9} {'samples':>12} {'steps/s':>8}"]
    for d in result["datasets"]:
        lines.append(f"{d['size_mb']:>8g}MB {d['rss_before_data_mb']:>12.1f} MB {d['peak_rss_mb']:>6.1f} MB "
                     f"{d['samples']:>12,} {d['steps_per_s']:>8.2f}")
    lines.append(f"peak RSS differs by {result['peak_rss_diff_mb']:.1f} MB (goal < {result['goal_mb']:g} MB): "
                 f"{'met' if result['goal_met'] else 'NOT met'}")
    p = result["prepare"]
    lines.append(f"data prepare: {p['input_mb']:.1f} MB, {p['tokens']:,} tokens in {p['tokenise_s']:.2f} s = "
                 f"{p['tokens_per_s']:,.0f} tokens/s on {p['cpus']} CPUs (BPE training + tokenising: "
                 f"{p['train_bpe_and_tokenise_s']:.2f} s)")
    return "\n".join(lines)
