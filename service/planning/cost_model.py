"""Estimates for one candidate layout: memory per device, step time, inter-DC bytes per step.

Pure arithmetic on a model's shape, a layout and measured (or declared) figures for compute and for each
link tier, so the planner can rank layouts and say why. The formulas, per optimizer step:

    compute   = tokens per replica x FLOPs/token / (tp x pp) / device FLOP/s, x (m + pp - 1) / m pipeline bubble
    tp comm   = 4 all-reduces per layer per micro-batch of (b x s x d) activations on the intra-node link
    pp comm   = (m + pp - 1) point-to-point transfers of (b x s x d) on the link between stages with 1F1B
                (activations down and gradients up share a tick: the link is full duplex), 2 (m + pp - 1)
                with GPipe
    dp comm   = hierarchical: reduce-scatter + all-gather of the gradients inside the DC, plus each DC's
                copy of the gradients over the shared inter-DC link (1 latency round for two DCs),
                flat: a ring over every replica, paced by the slowest link it crosses
    exposed   = dp comm not hidden behind the last micro-batch's backward pass (2/3 of its compute; earlier
                micro-batches only accumulate) when overlap is on, and at least the last bucket's share
                (bucket size / gradient bytes), which no backward can hide

The numbers are estimates, checked against measured step times by ``meridian bench plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meridian.workers.contracts.model_config import ModelConfig, ModelFamily

BYTES_FP32 = 4
ADAMW_STATE_BYTES = 2 * BYTES_FP32  # exp_avg + exp_avg_sq per parameter


@dataclass(frozen=True)
class Link:
    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: float, rounds: int = 1) -> float:
        return rounds * self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Figures:
    """What the hardware can do: compute per device and the three link tiers."""

    device_flops: float
    """Sustained training FLOP/s of one device (all devices busy at once)."""
    device_memory_bytes: float
    intra_node: Link
    intra_dc: Link
    inter_dc: Link
    """One direction of the link between two datacenters, shared by all ranks of a datacenter."""
    step_overhead_s: float = 0.0
    """Fixed per-step cost outside the model (optimizer, Python, logging), measured."""
    inter_dc_known: bool = False
    """``inter_dc`` was measured, declared or emulated (not a default): only then may the planner trade
    per-step sync for DiLoCo (:mod:`meridian.service.planning.sync_choice`)."""
    compute_known: bool = False
    """``device_flops`` and ``step_overhead_s`` were measured for this model shape (a compute probe), not a
    default: without them ``auto``'s per-step sync choice is armed to be checked at run time
    (:func:`meridian.service.planning.planner.armed_lookahead`)."""
    device_memory_known: bool = True
    """``device_memory_bytes`` came from the devices (a probe, or the GPU nodes' own reading); ``False`` for the
    GPU default, which a refusal then names as a guess."""
    bf16_autocast: bool = False
    """A job with ``precision: auto`` trains in bf16 autocast on these devices (GPUs), else in fp32 (CPUs)."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    """Model replicas in total (sum over datacenters)."""
    num_dcs: int
    dp_per_dc: int
    """Replicas per datacenter when replicas span DCs (pipeline inside a DC); 0 when stages span DCs."""
    pp_spans_dcs: bool
    micro_batch: int
    micro_batches: int
    """Micro-batches per replica per step (gradient accumulation / pipeline depth)."""
    hierarchical: bool
    shard_optimizer: bool
    overlap: bool
    schedule: str = "1f1b"
    """Pipeline schedule, ``1f1b`` or ``gpipe`` (when ``pp`` > 1)."""
    bucket_bytes: float = 4 * 2**20
    """Gradient bucket size (``sync.bucket_mb``): a model smaller than one bucket syncs only after backward."""
    fp32: bool = False
    """The job trains in fp32, not in bf16 autocast: its logits are one more fp32 tensor (:func:`activation_bytes`)."""
    encoded: bool = False
    """The job leaves the strategy to the planner but sets an inter-DC encoding (``sync.compression``): only the
    hierarchical engine has the step it encodes (flat sync refuses it), so even one datacenter runs that engine."""

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Estimate:
    memory_bytes: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    exposed_dp_s: float
    step_s: float
    inter_dc_bytes: float
    """Bytes per step crossing datacenter boundaries, summed over ranks (tensor bytes sent)."""

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def optimizer_share(lay: Layout) -> float:
    """The share of the whole model's AdamW one rank runs: the measured overhead is AdamW over the whole model on
    one device; a rank updates only its stage's TP slice, and with the sharded optimizer only its 1/N of that."""
    shards = lay.dp_per_dc if lay.dp_per_dc else lay.dp
    sharded = lay.shard_optimizer and lay.dp > 1 and runs_hierarchical(lay)
    return 1 / (lay.tp * lay.pp) / (max(1, shards) if sharded else 1)


def grad_bytes_per_device(model: ModelConfig, tp: int, pp: int) -> float:
    """One replica's fp32 gradient bytes on each of its devices (its tensor/pipeline slice of the model)."""
    return BYTES_FP32 * model.num_params / (tp * pp)


def activation_bytes(model: ModelConfig, micro_batch: int, layers: int, tp: int, *, fp32: bool = False) -> float:
    """Activations kept for backward, per micro-batch: Korthikanti et al. 2022, eq. 2 without its attention-score
    term (fp32 doubles their 16-bit figure), with TP dividing the attention/MLP part. Of their 24·sbh split by TP,
    8 are attention and 16 the GELU MLP's two 4h-wide tensors (4 bytes·sb per unit of width); a SwiGLU MLP keeps
    four tensors of its width (gate, up, their activation and product: 8 bytes·sb per unit). The score term
    (5·as²b) is left out because both families attend with ``scaled_dot_product_attention``, whose fused kernels
    keep no s × s matrix for backward. The logits cost two fp32 copies in bf16 autocast (the loss's fp32 logits
    and their gradient) and three in fp32, where the model's own logits are fp32 too. Measured on an H100 and an
    H200 (``tests/data/h100_step_memory.json``, ``h200_step_memory.json``): 1.10–1.17× a step's peak in bf16
    autocast, 1.04–1.14× in fp32 (with two copies in fp32: 0.90× at micro-batch 8, where a layout the planner
    passed could run out of memory); with the score term it was 2.4–4.3× the peak."""
    s, b, d = model.seq_len, micro_batch, model.d_model
    mlp = (8 if model.family is ModelFamily.LLAMA else 4) * model.mlp_width / d
    per_layer_16bit = s * b * d * (10 + (8 + mlp) / tp)
    logits_copies = 3 if fp32 else 2
    return 2 * per_layer_16bit * layers + logits_copies * BYTES_FP32 * b * s * model.vocab_size


def micro_batches_in_flight(lay: Layout) -> int:
    """The micro-batches whose activations a device holds at once (what the schedule in
    :mod:`meridian.workers.parallel.pipeline` keeps before their backward). The stage runner (any ``tp x pp`` > 1)
    under GPipe runs all ``m`` forwards before the first backward: ``m``. Under 1F1B the first stage runs ``pp - 1``
    forwards ahead, then one forward per backward: ``pp``, never more than ``m``. A plain data-parallel replica
    runs each micro-batch's backward before the next forward: one."""
    if lay.schedule == "gpipe" and lay.tp * lay.pp > 1:
        return lay.micro_batches
    return min(lay.pp, lay.micro_batches)


def memory_per_device(model: ModelConfig, lay: Layout, dc_shards: int) -> float:
    params = model.num_params / (lay.tp * lay.pp)
    # Sharded only where the hierarchical engine runs: flat sync (DDP) keeps the whole AdamW state on every rank.
    sharded = lay.shard_optimizer and lay.dp > 1 and runs_hierarchical(lay)
    optimizer = ADAMW_STATE_BYTES * params / (dc_shards if sharded else 1)
    # The busiest stage's layers: uneven depths put the extra layers on the first stages (5 on 4: 2, 1, 1, 1)
    one = activation_bytes(model, lay.micro_batch, -(-model.n_layers // lay.pp), lay.tp, fp32=lay.fp32)
    acts = one * micro_batches_in_flight(lay)
    return 2 * BYTES_FP32 * params + optimizer + acts  # params + grads + optimizer + activations


def lookahead_bytes(model: ModelConfig, lay: Layout) -> float:
    """What the one-step-late look-ahead (set, or armed and tried) adds on each device: the fp32 committed copy of
    the rank's optimizer shard and its datacenter's gradient shard kept for the look-ahead, plus two spare fp32
    gradient sets, where the sync one step late lands while the next backward fills the buckets."""
    params = model.num_params / (lay.tp * lay.pp)
    shards = max(1, lay.dp_per_dc if lay.dp_per_dc else lay.dp)
    return 2 * BYTES_FP32 * params / shards + 2 * BYTES_FP32 * params


def estimate(model: ModelConfig, lay: Layout, fig: Figures, global_batch: int) -> Estimate:
    tokens_per_replica = global_batch / lay.dp * model.seq_len
    work = tokens_per_replica * model.flops_per_token / (lay.tp * lay.pp)
    bubble = (lay.micro_batches + lay.pp - 1) / lay.micro_batches
    compute = work / fig.device_flops * bubble

    act = BYTES_FP32 * lay.micro_batch * model.seq_len * model.d_model
    layers_here = model.n_layers / lay.pp
    tp_comm = 0.0
    if lay.tp > 1:
        tp_comm = 4 * layers_here * lay.micro_batches * fig.intra_node.time(act * 2 * (lay.tp - 1) / lay.tp, rounds=2 * (lay.tp - 1))
    pp_comm = 0.0
    inter_dc = 0.0
    if lay.pp > 1:
        link = fig.inter_dc if lay.pp_spans_dcs else fig.intra_dc
        # One activation hop per schedule tick; 1F1B's steady state sends activations downstream and
        # gradients upstream in the same tick (the link is full duplex), GPipe runs the two phases apart.
        phases = 1 if lay.schedule == "1f1b" else 2
        pp_comm = phases * (lay.micro_batches + lay.pp - 1) * link.time(act / lay.tp)
        if lay.pp_spans_dcs:
            boundaries = lay.num_dcs - 1
            inter_dc += 2 * boundaries * lay.micro_batches * act * lay.dp  # fwd activations + bwd grads

    grads = grad_bytes_per_device(model, lay.tp, lay.pp)
    dp_comm, last_bucket = _dp_comm(lay, fig, grads)
    if lay.dp > 1 and not lay.pp_spans_dcs and lay.num_dcs > 1:
        # HAR: each DC sends one copy of the gradients (split over its ranks); flat: every rank sends all.
        inter_dc += (lay.num_dcs * grads * lay.tp * lay.pp) if lay.hierarchical else grads * lay.devices
    elif lay.dp > 1 and lay.pp_spans_dcs and lay.hierarchical is False:
        inter_dc += grads * lay.devices
    # Gradients sync only during the last micro-batch's backward (earlier ones only accumulate): that is
    # the window the sync can hide behind.
    backward = compute * 2 / 3 / lay.micro_batches
    exposed = max(dp_comm - backward, last_bucket) if lay.overlap else dp_comm
    shards = lay.dp_per_dc if lay.dp_per_dc else lay.dp
    step = compute + tp_comm + pp_comm + exposed + fig.step_overhead_s * optimizer_share(lay)
    return Estimate(
        memory_bytes=memory_per_device(model, lay, max(1, shards)), compute_s=compute, tp_comm_s=tp_comm,
        pp_comm_s=pp_comm, dp_comm_s=dp_comm, exposed_dp_s=exposed, step_s=step, inter_dc_bytes=inter_dc,
    )


def runs_hierarchical(lay: Layout) -> bool:
    """Whether the workers run ``lay`` with the hierarchical engine when the planner picks the strategy:
    across DCs when asked, always under tensor or pipeline parallelism (they run on FSDP2 under the hierarchical
    engine only), and whenever the job sets an inter-DC encoding (:attr:`Layout.encoded`)."""
    return (lay.hierarchical and (lay.num_dcs > 1 or lay.encoded) and not lay.pp_spans_dcs) or lay.pp > 1 \
        or lay.tp > 1


def _dp_comm(lay: Layout, fig: Figures, grads: float) -> tuple[float, float]:
    """(total data-parallel sync time, the part that is always exposed: the last bucket's sync)."""
    if lay.dp <= 1:
        return 0.0, 0.0
    last_fraction = min(1.0, lay.bucket_bytes / grads)  # the last bucket's share of the gradients
    if lay.pp_spans_dcs or lay.num_dcs == 1:
        n = lay.dp
        ring = fig.intra_dc.time(2 * (n - 1) / n * grads, rounds=2 * (n - 1))
        return ring, ring * last_fraction
    n = lay.dp_per_dc
    if lay.hierarchical:
        intra = fig.intra_dc.time(2 * (n - 1) / n * grads, rounds=2 * (n - 1)) if n > 1 else 0.0
        # every rank of the DC sends its 1/n shard over the one shared link: the link carries `grads` bytes
        rounds = 1 if lay.num_dcs == 2 else 2 * (lay.num_dcs - 1)
        cross = fig.inter_dc.time(grads * (lay.num_dcs - 1) if lay.num_dcs == 2 else 2 * (lay.num_dcs - 1) / lay.num_dcs * grads, rounds=rounds)
        total = intra + cross
        # The last bucket pays the inter-DC latency rounds whole and its share of the transfer.
        latency = rounds * fig.inter_dc.latency_s
        return total, intra * last_fraction + latency + (cross - latency) * last_fraction
    w = lay.dp
    # a flat ring over all replicas crosses each DC boundary; every step of the ring waits for the slow link
    ring = fig.inter_dc.time(2 * (w - 1) / w * grads, rounds=2 * (w - 1))
    return ring, ring * last_fraction
