"""Peak device memory of one training step (forward + backward + fused AdamW) against the planner's estimate."""
import json, torch
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.contracts.config import OptimConfig
from meridian.workers.model.build import build_model
from meridian.workers.model.gpt import per_sample_loss
from meridian.workers.optim.adamw import build_adamw
from meridian.service.planning.cost_model import activation_bytes, memory_per_device, Layout

dev = torch.device("cuda", 0)
rows = []
for name, cases in (("gpt2-124m", [("bf16", 4), ("bf16", 16), ("fp32", 4)]),
                    ("llama-160m", [("bf16", 2), ("bf16", 8), ("fp32", 2)])):
    cfg = model_preset(name)
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    opt = build_adamw(model, OptimConfig())
    P = sum(p.numel() for p in model.parameters())
    for prec, b in cases:
        dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), device=dev)
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=prec == "bf16"):
                loss = per_sample_loss(model(x[:, :-1]), x[:, 1:]).mean()
            loss.backward(); opt.step()
        step(); torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step(); torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
        lay = Layout(tp=1, pp=1, dp=1, num_dcs=1, dp_per_dc=1, pp_spans_dcs=False, micro_batch=b, micro_batches=1,
                     hierarchical=False, overlap=False)
        rows.append({"model": name, "precision": prec, "micro_batch": b, "params": P, "base_bytes": base,
                     "peak_bytes": peak, "above_base_minus_grads": peak - base - 4 * P,
                     "estimate_activation_bytes": activation_bytes(cfg, b, cfg.n_layers, 1),
                     "estimate_memory_bytes": memory_per_device(cfg, lay, 1)})
        print(json.dumps(rows[-1]), flush=True)
    del model, opt; torch.cuda.empty_cache()
