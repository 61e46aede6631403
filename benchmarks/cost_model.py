"""The cost model behind `benchmarks/cost.py --count` and `--predict`: the default path's wall time for an LLM
shape on N GPUs, from the work it counts and a device's rates.

The work (`count`): the default path runs on the shape's structure at a sliver of its width (`proxy`: its
blocks, query heads and KV groups, the MLP's share of a block and the output layer's share of the model kept),
its blocks offloaded to CPU memory and onloaded. That counts the fisher passes by stage, the refits, the rows of
text the general-ability guard writes and the copies of the offloaded weights moved. These follow the structure
(the units, blocks, rounds and the race's parts), not the width, so they stand for the shape's.

The rates (`Device`): a fisher pass's FLOPs a second in bfloat16, the refits' float64 FLOPs a second, the host
to device and peer bandwidths, memory. Measured on the device by `cost.py --rates`, else the figures beside
`H100`, each marked.

The prediction (`predict`) for N data-parallel processes, one a GPU: the passes split N ways; the refits on
every process (each solves all of them); the guard's text split by rows, but each process writes as many steps;
the statistics summed across processes once (a ring, 2 (N - 1) / N of their bytes over the peer link, and
through CPU memory as `sum_across` sends them); and where the weights do not fit the GPU beside their work, each
process onloading the copies the count says (the text's steps: a copy each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate.hooks import attach_align_device_hook_on_blocks
from accelerate.utils import OffloadedWeightsLoader
from memory import SHAPES
from transformers import AutoConfig, AutoModelForCausalLM

import prune_heads as ph
from prune_heads.model.onload import moved_bytes
from prune_heads.recovery import candidates, generated
from prune_heads.recovery.reconstruction import refit_flops
from prune_heads.runtime.ledger import Stage

LLAMA_31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_31 = dict(vocab_size=128256, tie_word_embeddings=False, rope_scaling=LLAMA_31_ROPE, rope_theta=500000.0)
CONFIGS = {  # the Hugging Face configs' shapes; weights random
    "smollm2-135m": ("llama", SHAPES["135m"]),  # the cost model's check: the shape itself against its proxy
    "llama-3.2-1b": ("llama", SHAPES["1b"]),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            **LLAMA_31,
        ),
    ),
    "llama-3.1-70b": (
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            **LLAMA_31,
        ),
    ),
}
CONFIG = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=1 / 3, round="nearest"))
PROXY_HEAD = 4  # the proxy's head width: the structure's counts need no more
GRADIENT_STAGES = ("scoring", "tuning")  # the passes that backpropagate; the rest run forward only


def config(shape: str, **changes) -> AutoConfig:
    """The shape's transformers config, with `changes`."""
    model_type, shape_config = CONFIGS[shape]
    return AutoConfig.for_model(model_type, max_position_embeddings=4096, **{**shape_config, **changes})


def on_meta(found: AutoConfig) -> torch.nn.Module:
    """The model of `found` with no weights in memory (its shapes alone)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(found, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Structure:
    """What a shape's cost follows: its blocks, the parameters its passes multiply (blocks and output layer: 6
    FLOPs each per token for a forward and backward pass), the bytes of its weights and of one block (bfloat16),
    the Gram matrices of its output projections' inputs that are summed across processes (both texts', upper
    triangles, float64) and one refit's counted FLOPs (a block without one KV group)."""

    shape: str
    layers: int
    matmul_parameters: int
    weight_bytes: int
    block_bytes: int
    statistics_bytes: int
    refit_flops: float


def structure(shape: str, **changes) -> Structure:
    """The shape's `Structure`, from its config (with `changes`)."""
    found = config(shape, **changes)
    model = on_meta(found)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    head = found.vocab_size * found.hidden_size
    layer = ph.find_attention(model)[0]
    width = layer.num_heads * layer.head_dim
    group = found.num_attention_heads // found.num_key_value_heads
    fit = refit_flops([layer], {layer.name: list(range(group))})
    return Structure(
        shape=shape,
        layers=found.num_hidden_layers,
        matmul_parameters=block * found.num_hidden_layers + head,
        weight_bytes=2 * model.num_parameters(),
        block_bytes=2 * block,
        statistics_bytes=found.num_hidden_layers * 2 * width * (width + 1) // 2 * 8,
        refit_flops=fit,
    )


def proxy(shape: str) -> AutoConfig:
    """The shape's structure at a sliver of its width: its blocks, query heads and KV groups, each head
    `PROXY_HEAD` wide, the MLP as wide against the attention as the shape's and a vocabulary that gives the
    output layer the shape's share of the passes' work."""
    real = config(shape)
    hidden = real.num_attention_heads * PROXY_HEAD
    narrow = dict(hidden_size=hidden, head_dim=PROXY_HEAD)
    narrow["intermediate_size"] = round(real.intermediate_size * hidden / real.hidden_size)
    full = structure(shape)
    head_share = real.vocab_size * real.hidden_size / full.matmul_parameters
    block = sum(p.numel() for p in on_meta(config(shape, **narrow, num_hidden_layers=1)).model.layers[0].parameters())
    vocab = round(head_share / (1 - head_share) * block * real.num_hidden_layers / hidden)
    return config(shape, **narrow, vocab_size=max(vocab, 64))


def offloaded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every decoder block's weights in CPU memory under accelerate's offload (weights on meta),
    as `device_map="auto"` with a GPU too small places them; the CPU stands for the execution device."""
    names = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    state = {k: v for k, v in model.state_dict().items() if k.startswith("model.layers.")}
    cpu = torch.device("cpu")
    attach_align_device_hook_on_blocks(
        model,
        execution_device=dict.fromkeys(names, cpu),
        offload=dict.fromkeys(names, True),
        weights_map=OffloadedWeightsLoader(state_dict=state),
    )
    return model


@dataclass(frozen=True)
class Counted:
    """The default path's counted work on a shape's proxy: fisher passes by stage (the refits' FLOPs taken out),
    the refits, the rows of text the guard writes, the calibration batches, the copies of the offloaded weights
    moved other than by writing the text, and the heads the plan removes."""

    shape: str
    passes: dict[str, float]
    refits: int
    written_rows: int
    batches: int
    copies: float
    removed: int


@dataclass
class _Counter:
    """What the proxy's run does beside its ledger: refits and their FLOPs, rows written, bytes moved writing."""

    refits: int = 0
    refit_flops: float = 0.0
    rows: int = 0
    writing_bytes: int = 0


def count(shape: str, batches: int, size: int, length: int, narrow: bool = True) -> Counted:
    """The default path's `Counted` work on the shape's `proxy` (the shape itself without `narrow`; random
    weights, bfloat16, onloaded), on `batches` random batches of `size` x `length` tokens."""
    from common import random_batches

    found = proxy(shape) if narrow else config(shape)
    torch.manual_seed(0)
    model = offloaded(AutoModelForCausalLM.from_config(found, dtype=torch.bfloat16).eval())
    data = random_batches(found.vocab_size, batches, size, length, "cpu")
    counter = _Counter()
    refit, write = candidates.refit, generated.write

    def counted_refit(layer, removed, *args, **kwargs):
        counter.refits += 1
        counter.refit_flops += refit_flops([layer], {layer.name: list(removed)})
        return refit(layer, removed, *args, **kwargs)

    def counted_write(model, prompts, *args, **kwargs):
        before = moved_bytes(model)
        written = write(model, prompts, *args, **kwargs)
        counter.rows += len(prompts)
        counter.writing_bytes += moved_bytes(model) - before
        return written

    candidates.refit, generated.write = counted_refit, counted_write
    try:
        result = ph.prune_model(model, data, CONFIG)
    finally:
        candidates.refit, generated.write = refit, write
    return _counted(shape, result, counter, batches)


def _counted(shape: str, result: ph.PruneResult, counter: _Counter, batches: int) -> Counted:
    work = result.work
    passes = {stage.value: work.passes([stage]) for stage in work.stages}
    for stage in (Stage.SEARCH.value, Stage.RECONSTRUCTION.value):  # the refits are counted apart
        passes[stage] = passes.get(stage, 0.0)
    share = counter.refit_flops / work.calibration_pass / max(1, passes["search"] + passes["reconstruction"])
    passes = {k: v * (1 - share) if k in ("search", "reconstruction") else v for k, v in passes.items()}
    copies = (work.moved_bytes - counter.writing_bytes) / work.offloaded_bytes
    return Counted(shape, passes, counter.refits, counter.rows, batches, copies, result.heads_removed)


@dataclass(frozen=True)
class Device:
    """A GPU's rates: a fisher pass's bfloat16 FLOPs a second, the refits' float64 FLOPs a second, memory,
    host to device and peer (all-reduce) bytes a second, memory bytes a second (a decoding step reads the
    weights once), and where the figures come from."""

    name: str
    pass_flops: float
    refit_flops: float
    memory: int
    host_bytes: float
    peer_bytes: float
    memory_bytes: float
    source: str


H100 = Device(
    name="H100 80GB (predicted)",
    pass_flops=6 * 8.03e9 * 16 * 8 * 256 / 5.0,  # measured: the 8B shape's scoring pass, 16 x 8 x 256 tokens, 5 s
    refit_flops=1807e9 / 0.86,  # measured: its search's 1.1 measurements a second, less a measurement's pass
    memory=80 * 2**30,
    host_bytes=25e9,  # assumed: PCIe 5 x16, pinned
    peer_bytes=200e9,  # assumed: NVLink all-reduce bus bandwidth
    memory_bytes=3.35e12,  # the H100 SXM's HBM3, data sheet
    source="the 8B shape's scoring pass and search rate on an H100 (benchmarks/README.md); links assumed",
)
WORKING = 1.25  # the weights must fit this many times over: activations and statistics beside them


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds by term for one shape, device and process count, and whether it onloads."""

    passes: float
    refits: float
    summing: float
    onloading: float
    writing: float
    onloaded: bool

    @property
    def total(self) -> float:
        return self.passes + self.refits + self.summing + self.onloading + self.writing


def predict(s: Structure, c: Counted, device: Device, processes: int, size: int, length: int) -> Prediction:
    """The default path's seconds on `processes` GPUs (data-parallel) for the count's batches of `size` x
    `length` tokens (the text it writes: memory-bound steps, not passes)."""
    onloaded = s.weight_bytes * WORKING > device.memory
    counted = sum(v for k, v in c.passes.items() if k != Stage.GENERATION.value)
    passes = counted * 6 * s.matmul_parameters * c.batches * size * length / (processes * device.pass_flops)
    refits = c.refits * s.refit_flops / device.refit_flops
    ring = 2 * (processes - 1) / processes * s.statistics_bytes / device.peer_bytes
    summing = ring + 2 * s.statistics_bytes / device.host_bytes if processes > 1 else 0.0
    width = max(1, generated.WRITE_TOKENS // length)
    steps = (length - 1) * math.ceil(math.ceil(c.written_rows / processes) / width)
    step = s.weight_bytes / (device.host_bytes if onloaded else device.memory_bytes)
    onloading = c.copies * s.block_bytes * s.layers / device.host_bytes if onloaded else 0.0
    return Prediction(passes, refits, summing, onloading, steps * step, onloaded)
