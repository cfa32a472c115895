"""Estimates for one candidate layout: memory per device, step time and its parts, inter-DC bytes per step.

Pure arithmetic on a model's shape (:class:`~meridian.workers.contracts.model_shape.ModelShape`), a layout and
measured (or declared, or calibrated) figures for compute and each link tier, so the planner can rank layouts and
say why. Per device, for the busiest pipeline stage (its layers, plus the embedding on the first stage or the
output head on the last):

Memory
    weights + gradients + AdamW state: replicated (flat DDP), the optimizer state sharded inside the datacenter
    (ZeRO-1: the hierarchical engine, Megatron's distributed optimizer), or all three sharded (FSDP, with the
    blocks' gathered copies while they compute); activations per layer and micro-batch after Korthikanti et al.
    2022 (*Reducing Activation Recomputation in Large Transformer Models*, Table 2) with or without sequence
    parallelism and with selective or full recomputation, times the micro-batches a stage holds at once (1F1B:
    ``pp`` on the first stage, ``x (1 + (pp - 1) / (pp v))`` interleaved; GPipe: all ``m``).
Time per optimizer step
    compute    = ``m + (pp - 1) / v`` micro-batch slots of the stage's forward, backward and recomputed FLOPs at
                 the device's sustained FLOP/s: the (interleaved) pipeline bubble is ``(pp - 1) / v`` slots
                 (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters*, §2.2)
    tp comm    = 4 all-reduces (or reduce-scatter + all-gather pairs with sequence parallelism) of ``b x s x h``
                 activations per layer and micro-batch slot on the intra-node link, 6 with full recomputation
    pp comm    = ``m v + pp - 1`` hops of ``b x s x h / tp`` (1F1B: activations down and gradients up share a
                 tick, the link is full duplex; GPipe twice); a hop across datacenters carries every replica's
                 activations over the one shared link
    dp comm    = hierarchical: reduce-scatter + all-gather of the gradients inside the DC, plus each DC's copy of
                 the whole model's gradients over the shared inter-DC link (1 latency round for two DCs); flat: a
                 ring over every replica, paced by the slowest link it crosses
    fsdp comm  = as the runtime runs FSDP2: under pipelining the stage's parameters all-gathered and its gradients
                 reduce-scattered once a step (the schedule defers resharding and the reduction to the last
                 micro-batch); without, the parameters gathered twice a micro-batch (they reshard after forward)
                 and the gradients reduce-scattered once a step, after the last micro-batch; hidden behind the
                 compute they overlap
    exposed    = dp comm not hidden behind the last micro-batch's backward and the pipeline's drain (earlier
                 micro-batches only accumulate) when overlap is on, and at least the share of what syncs last
                 (a DDP bucket, or the hierarchical engine's last FSDP2 unit: :func:`last_synced_bytes`)

The estimates are checked against measured step times by ``meridian bench plan`` and against published tables
by ``tests/test_published_tables.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from meridian.service.planning.buckets import buckets_of
from meridian.workers.contracts.config import FsdpUnits
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.contracts.model_shape import ModelShape

BYTES_FP32 = 4
BYTES_16 = 2
ADAMW_STATE_BYTES = 2 * BYTES_FP32  # exp_avg + exp_avg_sq per parameter
FP32_MASTER_BYTES = BYTES_FP32
"""The fp32 copy of the weights the optimizer updates when the blocks compute with bf16 copies."""


class Recompute(str, enum.Enum):
    """Activation recomputation per block (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"  # the attention core (scores, softmax, their product with V) recomputed in backward
    FULL = "full"  # only each block's input kept; the whole block's forward runs again in backward


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
    """One rank's share of the links between the nodes of a datacenter."""
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
    peak_flops: float = 0.0
    """Dense peak FLOP/s of one device in the training precision (a datasheet figure), which MFU divides by;
    0 where unknown (no MFU is given then)."""
    collective_s: float = 20e-6
    """The fixed cost of one data-parallel collective on a rank's training thread beyond its link time (launch,
    FSDP2's copies in and out, the ranks meeting): what makes many small collectives dearer than few large ones
    (:func:`collectives_per_step`)."""


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
    overlap: bool
    schedule: str = "1f1b"
    """Pipeline schedule, ``1f1b`` or ``gpipe`` (when ``pp`` > 1)."""
    bucket_bytes: float = 4 * 2**20
    """Flat sync's DDP bucket size (``sync.bucket_mb``): a model smaller than one bucket syncs only after backward.
    The hierarchical engine has no buckets: it syncs per FSDP2 unit (:func:`last_synced_bytes`)."""
    fp32: bool = False
    """The job trains in fp32, not in bf16 autocast: its logits are one more fp32 tensor (:func:`activation_bytes`)."""
    encoded: bool = False
    """The job leaves the strategy to the planner but sets an inter-DC encoding (``sync.compression``): only the
    hierarchical engine has the step it encodes (flat sync refuses it), so even one datacenter runs that engine."""
    virtual_stages: int = 1
    """Pipeline stages per device (interleaved 1F1B when > 1): the bubble shrinks by this factor, the hops grow."""
    sequence_parallel: bool = False
    """Tensor parallelism with sequence parallelism: what TP replicates (norms, block inputs) is split too."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation per block."""
    fsdp: bool = False
    """Parameters, gradients and optimizer state sharded over the datacenter's replicas (FSDP; HSDP across DCs)."""
    fsdp_units: FsdpUnits = FsdpUnits.BLOCK
    """FSDP2's units (one per block, or the whole model as one): what the hierarchical engine syncs in pieces."""
    reshard_after_forward: bool = True
    """FSDP frees each block's gathered weights after its forward and gathers them again for backward, in every
    micro-batch; ``False`` keeps them gathered from a step's first forward to its last backward (one gather per
    step, the stage's whole weights held). Under pipelining the schedule gathers once a step either way."""
    bf16_weights: bool = False
    """Blocks compute with bf16 copies of the weights, so saved activations take 16 bits; ``False``: fp32
    weights under autocast, whose saved activations measured about twice the 16-bit count."""
    dp_in_node: bool = False
    """Each datacenter's data-parallel group stays on one node (its collectives use the intra-node link)."""

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def shards(self) -> int:
        """Ranks the sharded state is split over: a datacenter's replicas (every replica with stages across DCs)."""
        return max(1, self.dp_per_dc if self.dp_per_dc else self.dp)

    @property
    def optimizer_sharded(self) -> bool:
        """The AdamW state is sharded: FSDP, or any layout the hierarchical engine runs (it shards the optimizer
        state inside each datacenter). Flat sync (DDP) keeps the whole AdamW state on every rank."""
        return self.fsdp or (self.dp > 1 and runs_hierarchical(self))


@dataclass(frozen=True)
class Estimate:
    memory_bytes: float
    compute_s: float
    """Forward, backward and recomputation of every micro-batch slot, the pipeline bubble included."""
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    exposed_dp_s: float
    step_s: float
    inter_dc_bytes: float
    """Bytes per step crossing datacenter boundaries, summed over ranks (tensor bytes sent)."""
    bubble_s: float = 0.0
    """The part of ``compute_s`` the pipeline's fill and drain leave idle."""
    recompute_s: float = 0.0
    """The part of ``compute_s`` spent recomputing activations."""
    fsdp_comm_s: float = 0.0
    """FSDP's all-gathers and reduce-scatters not hidden behind compute."""
    optimizer_s: float = 0.0
    """The optimizer step and the rest of the measured per-step overhead."""
    collectives_s: float = 0.0
    """The data-parallel collectives' fixed costs (:attr:`Figures.collective_s` each)."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs (:attr:`ModelShape.flops_per_token`, no recomputation) per second over the devices' peak; 0
    where the peak is unknown."""

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def shape_of(model: ModelShape | ModelConfig) -> ModelShape:
    """The shape the cost model reads (a :class:`ModelConfig` is read as its shape)."""
    return model if isinstance(model, ModelShape) else ModelShape.of(model)


def optimizer_share(lay: Layout) -> float:
    """The share of the whole model's AdamW one rank runs: the measured overhead is AdamW over the whole model on
    one device; a rank updates only its stage's TP slice, and with the sharded optimizer only its 1/N of that."""
    return 1 / (lay.tp * lay.pp) / (lay.shards if lay.optimizer_sharded else 1)


def grad_bytes_per_device(model: ModelShape | ModelConfig, tp: int, pp: int) -> float:
    """One replica's fp32 gradient bytes on each of its devices (its tensor/pipeline slice of the model)."""
    return BYTES_FP32 * shape_of(model).num_params / (tp * pp)


# -- memory ----------------------------------------------------------------------------------------------
def stage_layers(shape: ModelShape, pp: int) -> tuple[int, int]:
    """(layers of the first stage, layers of the last): uneven depths put the extra layers on the first stages
    (5 on 4: 2, 1, 1, 1), as :mod:`meridian.workers.parallel.pipeline` does."""
    return -(-shape.n_layers // pp), shape.n_layers // pp if pp > 1 else shape.n_layers


def stage_params(shape: ModelShape, pp: int) -> tuple[float, float]:
    """(parameters of the first stage, of the last): their layers plus the embedding, or plus the final norm and
    the head (a tied head on a separate last stage keeps its own copy of the embedding's weight)."""
    if pp == 1:
        return (float(shape.num_params),) * 2
    first, last = stage_layers(shape, pp)
    tied_copy = shape.vocab_size * shape.hidden if shape.tie_embeddings else 0
    return (first * shape.layer_params + shape.embedding_params,
            last * shape.layer_params + shape.head_params + tied_copy)


def layer_activation_bytes(model: ModelShape | ModelConfig, micro_batch: int, tp: int, *,
                           sequence_parallel: bool = False, recompute: Recompute = Recompute.NONE,
                           fused_attention: bool = True, bf16_weights: bool = False) -> float:
    """Bytes one layer keeps for backward per micro-batch: Korthikanti et al. 2022, Table 2, in units of
    ``s·b·h`` 16-bit bytes: 10 that TP replicates (the two norms' inputs 4, the attention's and MLP's inputs 4,
    two dropout masks 2) and 8 it splits for attention (Q, K, V and the attention's output, at the width of every
    query head: the kernels take K and V expanded to the query heads), plus the MLP's saved tensors (GELU, squared
    ReLU: 2 of its width; SwiGLU: 4), plus ``5·a·s/h`` of attention scores where the kernel is not fused (flash /
    ``scaled_dot_product_attention`` keeps no ``s x s`` matrix). Sequence parallelism splits the 10 too;
    selective recomputation drops the scores; full recomputation keeps only the layer's input (2, split by
    sequence parallelism). Without bf16 compute weights (fp32 weights under autocast) the figure is doubled:
    measured on an H100 and an H200 (``tests/data/h100_step_memory.json``, ``h200_step_memory.json``) that made
    the estimate 1.10–1.17x a step's peak in bf16 autocast, 1.04–1.14x in fp32."""
    shape = shape_of(model)
    s, b, h = shape.seq_len, micro_batch, shape.hidden
    sp = tp if sequence_parallel else 1
    scale = 1 if bf16_weights else 2
    if recompute is Recompute.FULL:
        return scale * BYTES_16 * s * b * h / sp
    split = 8 * shape.attention_width / h + BYTES_16 * shape.mlp.saved_tensors * shape.ffn_hidden / h
    scores = 0.0 if fused_attention or recompute is Recompute.SELECTIVE else 5 * shape.n_heads * s / h
    return scale * s * b * h * (10 / sp + (split + scores) / tp)


def logits_bytes(model: ModelShape | ModelConfig, micro_batch: int, *, fp32: bool = False, vocab_split: int = 1) -> float:
    """The logits' bytes per micro-batch on the last stage: two fp32 copies in bf16 autocast (the loss's fp32
    logits and their gradient), three in fp32 where the model's own logits are fp32 too; split over the tensor
    ranks where the loss is vocab-parallel (``vocab_split``)."""
    shape = shape_of(model)
    return (3 if fp32 else 2) * BYTES_FP32 * micro_batch * shape.seq_len * shape.vocab_size / vocab_split


def activation_bytes(model: ModelShape | ModelConfig, micro_batch: int, layers: int, tp: int, *, fp32: bool = False,
                     sequence_parallel: bool = False, recompute: Recompute = Recompute.NONE,
                     bf16_weights: bool = False) -> float:
    """Activations of ``layers`` layers kept for backward, per micro-batch, with the logits
    (:func:`layer_activation_bytes`, :func:`logits_bytes`)."""
    per_layer = layer_activation_bytes(model, micro_batch, tp, sequence_parallel=sequence_parallel,
                                       recompute=recompute, bf16_weights=bf16_weights)
    return per_layer * layers + logits_bytes(model, micro_batch, fp32=fp32, vocab_split=tp if sequence_parallel else 1)


def micro_batches_in_flight(lay: Layout) -> int:
    """The micro-batches whose activations the first stage holds at once (what the schedule in
    :mod:`meridian.workers.parallel.pipeline` keeps before their backward). The stage runner (any ``tp x pp`` > 1)
    under GPipe runs all ``m`` forwards before the first backward: ``m``. Under 1F1B the first stage runs ``pp - 1``
    forwards ahead, then one forward per backward: ``pp``, never more than ``m``. A plain data-parallel replica
    runs each micro-batch's backward before the next forward: one."""
    if lay.schedule == "gpipe" and lay.tp * lay.pp > 1:
        return lay.micro_batches
    return min(lay.pp, lay.micro_batches)


def _in_flight_layers(lay: Layout, layers: int, *, last: bool) -> float:
    """Layer-micro-batches of activations a stage holds at once: the first stage ``pp`` micro-batches of its
    layers under 1F1B (interleaved: ``x (1 + (pp - 1) / (pp v))``, Korthikanti et al. 2022 §4.2.3), the last one;
    GPipe every micro-batch on both."""
    if lay.schedule == "gpipe" and lay.tp * lay.pp > 1:
        return lay.micro_batches * layers
    if last and lay.pp > 1:
        return layers
    held = micro_batches_in_flight(lay) * layers
    if lay.virtual_stages > 1:
        held *= 1 + (lay.pp - 1) / (lay.pp * lay.virtual_stages)
    return held


def state_bytes(params: float, lay: Layout, layer_params: float) -> float:
    """Weights, gradients and AdamW state of ``params`` parameters on one device, with what FSDP holds unsharded as
    the runtime runs it: the sharded fp32 state, plus two blocks' weights (the one computing, the one prefetched),
    or the whole stage's weights under pipelining (the schedule reshards them after the last micro-batch only) or
    where they are kept gathered (:attr:`Layout.reshard_after_forward` off);
    and the fp32 gradients the micro-batches accumulate before the step's one reduce-scatter: the whole stage's
    when a step has more than one micro-batch or a pipeline, else one block's at a time. Across datacenters
    (replicas in several DCs) one more fp32 gradient shard: the receives the inter-DC exchange posts a step ahead
    (:class:`~meridian.workers.wan.exchange.PostedReceives`)."""
    n = lay.shards
    weight = BYTES_16 if lay.bf16_weights else BYTES_FP32
    if lay.fsdp:
        whole = lay.pp > 1 or lay.fsdp_units is FsdpUnits.MODEL  # the stage gathered, reduced at once
        gathered = params if whole or not lay.reshard_after_forward else 2 * layer_params
        unsharded_grads = params if whole or lay.micro_batches > 1 else layer_params
        posted = 1 if lay.num_dcs > 1 and not lay.pp_spans_dcs and lay.dp > 1 else 0
        return ((2 * BYTES_FP32 + ADAMW_STATE_BYTES + posted * BYTES_FP32) * params / n + weight * gathered
                + BYTES_FP32 * unsharded_grads)
    optimizer = ADAMW_STATE_BYTES + (FP32_MASTER_BYTES if lay.bf16_weights else 0)
    return (weight + BYTES_FP32) * params + optimizer * params / (n if lay.optimizer_sharded else 1)


def memory_per_device(model: ModelShape | ModelConfig, lay: Layout, dc_shards: int | None = None) -> float:
    """Peak bytes on the busiest device: the first stage (its layers, the embedding, the most micro-batches in
    flight) or the last (its layers, the head, the logits). ``dc_shards``: ranks the sharded state is split over
    (default :attr:`Layout.shards`)."""
    shape = shape_of(model)
    if dc_shards is not None and dc_shards != lay.shards:
        lay = _with_shards(lay, dc_shards)
    per_layer = layer_activation_bytes(shape, lay.micro_batch, lay.tp, sequence_parallel=lay.sequence_parallel,
                                       recompute=lay.recompute, bf16_weights=lay.bf16_weights)
    # full recomputation re-creates one layer's activations at a time during backward
    working = 0.0
    if lay.recompute is Recompute.FULL:
        working = layer_activation_bytes(shape, lay.micro_batch, lay.tp, sequence_parallel=lay.sequence_parallel,
                                         bf16_weights=lay.bf16_weights)
    logits = logits_bytes(shape, lay.micro_batch, fp32=lay.fp32, vocab_split=lay.tp if lay.sequence_parallel else 1)
    first_layers, last_layers = stage_layers(shape, lay.pp)
    first_params, last_params = stage_params(shape, lay.pp)
    layer = shape.layer_params / lay.tp
    last_flight = _in_flight_layers(lay, last_layers, last=True)
    # the re-run block's activations come after the loss's backward has freed the logits: one or the other at once
    last = (state_bytes(last_params / lay.tp, lay, layer) + per_layer * last_flight
            + max(working, logits * max(1, last_flight // max(1, last_layers))))
    if lay.pp == 1:
        return last
    first = state_bytes(first_params / lay.tp, lay, layer) + per_layer * _in_flight_layers(lay, first_layers, last=False) + working
    return max(first, last)


def _with_shards(lay: Layout, n: int) -> Layout:
    return replace(lay, dp_per_dc=n) if lay.dp_per_dc else replace(lay, dp=n)


def lookahead_bytes(model: ModelShape | ModelConfig, lay: Layout) -> float:
    """What the one-step-late look-ahead (set, or armed and tried) adds on each device: the fp32 committed copy of
    the rank's optimizer shard and its datacenter's gradient shard kept for the look-ahead, plus two spare fp32
    gradient sets, where the sync one step late lands while the next backward fills the buckets."""
    params = shape_of(model).num_params / (lay.tp * lay.pp)
    return 2 * BYTES_FP32 * params / lay.shards + 2 * BYTES_FP32 * params


# -- time ------------------------------------------------------------------------------------------------
def _stage_flops_per_token(shape: ModelShape, lay: Layout) -> tuple[float, float]:
    """(training FLOPs per token of the busiest stage's slice on one device, of them the recomputation's)."""
    first, last = stage_layers(shape, lay.pp)
    layer = shape.layer_forward_flops_per_token
    redo = {Recompute.NONE: 0.0, Recompute.SELECTIVE: float(shape.attention_core_flops_per_token),
            Recompute.FULL: float(layer)}[lay.recompute]
    head = 3 * shape.head_forward_flops_per_token
    first_flops, last_flops = first * (3 * layer + redo), last * (3 * layer + redo) + head
    busiest, layers = (first_flops, first) if first_flops >= last_flops else (last_flops, last)
    return busiest / lay.tp, layers * redo / lay.tp


def hardware_flops_per_token(model: ModelShape | ModelConfig, recompute: Recompute = Recompute.NONE) -> float:
    """FLOPs the devices run per trained token, recomputation included: with full recomputation Narayanan et al.
    2021's ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` per step for a GPT (their TFLOP/s per GPU counts these)."""
    shape = shape_of(model)
    layer = shape.layer_forward_flops_per_token
    redo = {Recompute.NONE: 0, Recompute.SELECTIVE: shape.attention_core_flops_per_token, Recompute.FULL: layer}[recompute]
    return shape.n_layers * (3 * layer + redo) + 3 * shape.head_forward_flops_per_token


def _tp_comm_per_slot(shape: ModelShape, lay: Layout, fig: Figures) -> float:
    """One micro-batch's tensor-parallel collectives on the busiest stage: per layer 2 in forward and 2 in
    backward (all-reduces, or reduce-scatter + all-gather pairs of the same bytes with sequence parallelism), 2
    more where full recomputation runs the forward again."""
    if lay.tp == 1:
        return 0.0
    act = (BYTES_16 if lay.bf16_weights else BYTES_FP32) * lay.micro_batch * shape.seq_len * shape.hidden
    per_layer = 6 if lay.recompute is Recompute.FULL else 4
    one = fig.intra_node.time(act * 2 * (lay.tp - 1) / lay.tp, rounds=2 * (lay.tp - 1))
    return per_layer * stage_layers(shape, lay.pp)[0] * one


def estimate(model: ModelShape | ModelConfig, lay: Layout, fig: Figures, global_batch: int) -> Estimate:
    shape = shape_of(model)
    tokens_per_replica = global_batch / lay.dp * shape.seq_len
    stage_flops, redo_flops = _stage_flops_per_token(shape, lay)
    # 1) compute: the stage's FLOPs per micro-batch in every slot, (pp - 1) / v of them the bubble
    m = lay.micro_batches
    tokens_per_mb = tokens_per_replica / m
    per_slot = tokens_per_mb * stage_flops / fig.device_flops
    bubble_slots = (lay.pp - 1) / lay.virtual_stages
    compute = per_slot * (m + bubble_slots)
    recompute = tokens_per_mb * redo_flops / fig.device_flops * m

    # 2) tensor parallelism inside each slot, so the bubble stretches with it
    tp_comm = _tp_comm_per_slot(shape, lay, fig) * (m + bubble_slots)

    # 3) pipeline hops
    act = (BYTES_16 if lay.bf16_weights else BYTES_FP32) * lay.micro_batch * shape.seq_len * shape.hidden
    pp_comm = inter_dc = 0.0
    if lay.pp > 1:
        phases = 1 if lay.schedule == "1f1b" else 2
        ticks = phases * (m * lay.virtual_stages + lay.pp - 1)
        if lay.pp_spans_dcs:
            # every replica's boundary ranks send at once over the one link between the DCs
            pp_comm = ticks * fig.inter_dc.time(act * lay.dp)
            crossings = lay.virtual_stages * (lay.num_dcs - 1) + (lay.virtual_stages - 1)
            inter_dc += 2 * crossings * m * act * lay.dp  # fwd activations + bwd grads
        else:
            pp_comm = ticks * fig.intra_dc.time(act / lay.tp)

    # 4) data-parallel sync and FSDP
    grads = BYTES_FP32 * max(stage_params(shape, lay.pp)) / lay.tp
    dp_comm, last_piece, cross = _dp_comm(lay, fig, grads, last_synced_bytes(shape, lay), sync_pieces(shape, lay))
    model_grads = BYTES_FP32 * shape.num_params
    if lay.dp > 1 and not lay.pp_spans_dcs and lay.num_dcs > 1:
        # HAR (and HSDP): each DC sends one copy of the gradients (split over its ranks); flat: every rank sends all
        inter_dc += lay.num_dcs * model_grads if (lay.hierarchical or lay.fsdp) else grads * lay.devices
    elif lay.dp > 1 and lay.pp_spans_dcs and lay.hierarchical is False:
        inter_dc += grads * lay.devices
    fsdp = _fsdp_exposed(shape, lay, fig, compute - per_slot * bubble_slots, m)
    # Gradients sync only during the last micro-batch's backward (earlier ones only accumulate). The first stage
    # finishes last and its ring inside the DC waits for that backward alone; the shared inter-DC link also
    # carries the later stages' gradients, complete while the pipeline drains.
    redo = 1 if lay.recompute is Recompute.FULL else 0
    backward = per_slot * (2 + redo) / (3 + redo)
    intra = dp_comm - cross
    hidden_cross = cross - max(0.0, backward - intra) - backward * bubble_slots
    exposed = max(intra - backward, 0.0) + max(hidden_cross, 0.0)
    exposed = max(exposed, last_piece) if lay.overlap else dp_comm
    optimizer = fig.step_overhead_s * optimizer_share(lay)
    collectives = fig.collective_s * collectives_per_step(shape, lay)
    step = compute + tp_comm + pp_comm + exposed + fsdp + optimizer + collectives
    tokens = global_batch * shape.seq_len
    mfu = tokens * shape.flops_per_token / (step * lay.devices * fig.peak_flops) if fig.peak_flops else 0.0
    return Estimate(
        memory_bytes=memory_per_device(shape, lay), compute_s=compute, tp_comm_s=tp_comm, pp_comm_s=pp_comm,
        dp_comm_s=dp_comm, exposed_dp_s=exposed, step_s=step, inter_dc_bytes=inter_dc,
        bubble_s=per_slot * bubble_slots, recompute_s=recompute, fsdp_comm_s=fsdp, optimizer_s=optimizer,
        collectives_s=collectives,
        tokens_per_s=tokens / step, mfu=mfu,
    )


def collectives_per_step(model: ModelShape | ModelConfig, lay: Layout) -> int:
    """The data-parallel collectives one rank runs a step. Flat sync: one all-reduce per DDP bucket. The
    hierarchical engine, per FSDP2 unit (each block and the root, or the whole model as one): its all-gathers
    (once a step where kept gathered or under pipelining, else in each micro-batch's forward and, for a block,
    again in its backward) and one reduce-scatter, where a datacenter has several ranks to shard over, and its
    exchange across datacenters."""
    if not runs_hierarchical(lay):
        return sync_pieces(model, lay) if lay.dp > 1 else 0
    blocks = sync_pieces(model, lay) - 1  # the units but the root
    once = lay.pp > 1 or not lay.reshard_after_forward
    m = lay.micro_batches
    count = 0
    if lay.shards > 1:
        count += blocks * ((1 if once else 2 * m) + 1) + (1 if once else m) + 1  # the blocks, then the root
    if lay.dp > 1 and lay.num_dcs > 1 and not lay.pp_spans_dcs:
        count += blocks + 1
    return count


def runs_hierarchical(lay: Layout) -> bool:
    """Whether the workers run ``lay`` with the hierarchical engine when the planner picks the strategy:
    across DCs when asked, always under tensor or pipeline parallelism (they run on FSDP2 under the hierarchical
    engine only), whenever the job sets an inter-DC encoding (:attr:`Layout.encoded`), and under FSDP, whose
    reduce-scatter inside the DC is the hierarchical engine's first step."""
    return (lay.hierarchical and (lay.num_dcs > 1 or lay.encoded) and not lay.pp_spans_dcs) or lay.pp > 1 \
        or lay.tp > 1 or lay.fsdp


def _fsdp_exposed(shape: ModelShape, lay: Layout, fig: Figures, busy_s: float, m: int) -> float:
    """FSDP's collectives inside the DC that compute does not hide, as the runtime runs them: under pipelining the
    stage's weights gathered and its gradients reduce-scattered once a step; without, the weights gathered twice a
    micro-batch (they reshard after forward), or once a step where they stay gathered, and the gradients
    reduce-scattered once, after the last micro-batch.
    FSDP2 prefetches the next block's gather during the current block and reduce-scatters a block's gradients
    during the next block's backward, so only what exceeds ``busy_s`` is exposed, and at least one block's gather
    (the first, with nothing before it to hide behind) per gathering pass."""
    if not lay.fsdp or lay.shards < 2:
        return 0.0
    n = lay.shards
    link = fig.intra_node if lay.dp_in_node else fig.intra_dc
    params = max(stage_params(shape, lay.pp)) / lay.tp
    weight = BYTES_16 if lay.bf16_weights else BYTES_FP32
    gathers = 1 if lay.pp > 1 or not lay.reshard_after_forward else m if lay.fsdp_units is FsdpUnits.MODEL else 2 * m
    gather = link.time(weight * params * (n - 1) / n, rounds=n - 1)
    scatter = link.time(BYTES_FP32 * params * (n - 1) / n, rounds=n - 1)
    total = gathers * gather + scatter
    if lay.fsdp_units is FsdpUnits.MODEL:  # one unit: its gather precedes forward, its reduce-scatter follows backward
        return total
    first_block = gather * shape.layer_params / (lay.tp * params)
    return max(total - busy_s, gathers * first_block)


def last_synced_bytes(model: ModelShape | ModelConfig, lay: Layout) -> float:
    """The fp32 gradient bytes on one device that sync last, once backward has ended, so their sync is never
    hidden. Under flat sync DDP's last bucket (``lay.bucket_bytes``, or the whole slice if smaller). The
    hierarchical engine syncs per FSDP2 unit (:func:`meridian.workers.parallel.fsdp.apply_fsdp`: each transformer
    block, then the root, or the whole model as one unit: :attr:`Layout.fsdp_units`); the root's gradients are
    complete last, when backward reaches the embedding. The root
    holds what the blocks do not: the embedding and, in one stage, the final norm and the head; under pipelining
    the first stage, the last to finish backward, holds the embedding."""
    shape = shape_of(model)
    grads = BYTES_FP32 * max(stage_params(shape, lay.pp)) / lay.tp
    if not runs_hierarchical(lay):
        return min(lay.bucket_bytes, grads)
    if lay.fsdp_units is FsdpUnits.MODEL and lay.pp == 1:  # one unit: the whole sync follows backward
        return grads
    first_layers, _ = stage_layers(shape, lay.pp)
    root = stage_params(shape, lay.pp)[0] - first_layers * shape.layer_params
    return min(BYTES_FP32 * root / lay.tp, grads)


def hierarchical_last_sync_mb(model: ModelShape | ModelConfig) -> float:
    """:func:`last_synced_bytes` in MiB for a data-parallel replica of ``model`` across datacenters under the
    hierarchical engine (the sync choice's ``last_sync_mb``)."""
    lay = Layout(tp=1, pp=1, dp=2, num_dcs=2, dp_per_dc=1, pp_spans_dcs=False, micro_batch=1, micro_batches=1,
                 hierarchical=True, overlap=True)
    return last_synced_bytes(model, lay) / 2**20


def sync_pieces(model: ModelShape | ModelConfig, lay: Layout) -> int:
    """The separate collectives a step's data-parallel sync is cut in, each paying its link's latency rounds:
    DDP's buckets under flat sync, the FSDP2 units under the hierarchical engine (each block and the root, or
    the whole model as one)."""
    if not runs_hierarchical(lay):
        return buckets_of(grad_bytes_per_device(model, lay.tp, lay.pp), lay.bucket_bytes / 2**20)
    if lay.fsdp_units is FsdpUnits.MODEL and lay.pp == 1:
        return 1
    return stage_layers(shape_of(model), lay.pp)[0] + 1


def _dp_comm(lay: Layout, fig: Figures, grads: float, last_bytes: float, pieces: int) -> tuple[float, float, float]:
    """(total data-parallel sync time, the part that is always exposed: the sync of what completes last
    (``last_bytes``, :func:`last_synced_bytes`), the part on the inter-DC link). ``grads``: one device's gradient
    bytes; every model-parallel rank's sync shares the inter-DC link. ``pieces``: the collectives the sync is cut
    in (:func:`sync_pieces`), each paying its latency rounds (the bytes share the link)."""
    if lay.dp <= 1:
        return 0.0, 0.0, 0.0
    last_fraction = min(1.0, last_bytes / grads)  # the share of the gradients synced last
    intra_link = fig.intra_node if lay.dp_in_node else fig.intra_dc
    if lay.pp_spans_dcs or lay.num_dcs == 1:
        if lay.fsdp:
            return 0.0, 0.0, 0.0  # FSDP's reduce-scatters run per micro-batch (_fsdp_exposed)
        n = lay.dp
        rounds = 2 * (n - 1)
        ring = intra_link.time(2 * (n - 1) / n * grads, rounds=rounds * pieces)
        last = intra_link.time(2 * (n - 1) / n * grads * last_fraction, rounds=rounds)
        return ring, last, 0.0
    n = lay.dp_per_dc
    on_link = grads * lay.tp * lay.pp  # every model-parallel rank's gradients cross the one link
    if lay.hierarchical or lay.fsdp:
        intra = 0.0 if lay.fsdp or n <= 1 else intra_link.time(2 * (n - 1) / n * grads, rounds=2 * (n - 1) * pieces)
        # every rank of the DC sends its 1/n shard over the one shared link: the link carries a model's gradients
        rounds = 1 if lay.num_dcs == 2 else 2 * (lay.num_dcs - 1)
        carried = on_link * (lay.num_dcs - 1) if lay.num_dcs == 2 else 2 * (lay.num_dcs - 1) / lay.num_dcs * on_link
        cross = fig.inter_dc.time(carried, rounds=rounds * pieces)
        total = intra + cross
        # What syncs last pays the inter-DC latency rounds whole and its share of the transfer.
        last = intra * last_fraction + fig.inter_dc.time(carried * last_fraction, rounds=rounds)
        return total, last, cross
    w = lay.dp
    # a flat ring over all replicas crosses each DC boundary; every step of every bucket's ring waits for the slow
    # link (``meridian bench sync``: docs/benchmarks/sync.md)
    rounds = 2 * (w - 1)
    ring = fig.inter_dc.time(2 * (w - 1) / w * on_link, rounds=rounds * pieces)
    last = fig.inter_dc.time(2 * (w - 1) / w * on_link * last_fraction, rounds=rounds)
    return ring, last, ring
