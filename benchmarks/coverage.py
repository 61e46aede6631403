"""Coverage: every model type transformers can build, as a tiny random model, sorted by what pruning does to it.

For each type in transformers' config mapping, the config is built as a user sizes a small model: widths,
heads and vocabulary small (4 heads, 2 KV heads where the config has them, width 32, small images), the
default depth and layer pattern kept (hybrid models keep their shared blocks and layer types), and weights
drawn with initializer_range 0.1 so that a wrong cut shows clearly. The model class is taken from the auto
mappings (causal LM first, then the base model) and run on random inputs; a type that fails is tried again up
LADDER (2 layers, then configs that keep more of the default). Types that cannot be built or run any way are
counted apart. The rest get an uneven plan on the first and last attention layers the forward pass reaches
(one KV group from the first, two from the last where it has three or more; query heads where a layer has one
KV group), and land in one of:

  exact       zeroed gates equal removal, fewer parameters, and save -> load gives the same outputs and
              parameters
  unstable    the unpruned model's own output moves by more than the tolerance between 1 and 2 threads (a
              discontinuity downstream, such as D-FINE's top-k query selection, turns float rounding into O(1)
              changes), so no model-level comparison decides; every pruned layer, run inside the pruned model,
              equals the gated original layer on its inputs, and save -> load is exact
  refused     PlanError / UnsupportedModelError at prune time, model untouched (a clear error)
  wrong       accepted, then a different output, more parameters, or a reload that differs
  crash       accepted, then a crash in forward, save or load
  not found   attention modules present (class name says attention, owns a projection or projection-like
              parameter tensors) but find_attention lists none and refuses nothing
  not run     random inputs reach none of the layers find_attention lists (counted apart, like "not built")

Usage: python benchmarks/coverage.py [--types llama,gpt_neox] [--json coverage.json] [--seconds 60] [--memory-gib 8]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import inspect
import json
import resource
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import transformers
from torch import nn
from torch.utils._pytree import tree_leaves
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto import modeling_auto
from transformers.utils import logging

import prune_heads as ph
from prune_heads.model.gates import gate_hook
from prune_heads.model.hooks import hooks
from prune_heads.model.inputs import dummy_inputs
from prune_heads.model.layers import resolve

logging.set_verbosity_error()
logging.disable_progress_bar()
warnings.filterwarnings("ignore")

TINY = {  # attribute: value, wherever a (sub-)config has it
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "dim": 32,
    "embed_dim": 32,
    "embedding_size": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "d_kv": 8,
    "kv_channels": 8,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "d_ff": 64,
    "n_inner": 64,
    "hidden_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "rotary_dim": 4,
    "window_size": 4,
    "vocab_size": 128,
    "image_size": 32,
    "patch_size": 8,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "top_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "projection_dim": 32,
    "projection_size": 32,
    "text_embed_dim": 32,
    "vision_embed_dim": 32,
    "initializer_range": 0.1,  # larger than any default: a wrong cut shows clearly
}
PARAMETER_CAP = 30_000_000


LAYER_COUNTS = {
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
}
STAGES = frozenset({"out_features", "out_indices", "stage_names"})  # a backbone's: derived again when named
LADDER = (  # (sizes left at the default or derived again, tokens): tried in turn until a model builds and runs
    (LAYER_COUNTS, 8),  # as users size a small model: the default depth, for configs whose layer pattern it shapes
    (frozenset(), 8),
    (STAGES, 8),
    (STAGES | {"image_size", "patch_size", "window_size", "rotary_dim"}, 32),
    # default widths, 2 layers, under the cap (positions and vocabulary stay small: tables of the default
    # length outgrow the machine's memory for some types)
    (STAGES | frozenset(TINY) - LAYER_COUNTS - {"vocab_size", "max_position_embeddings"}, 64),
)


def tiny_overrides(config: PretrainedConfig, kept: frozenset = frozenset()) -> dict:
    """Constructor arguments that make every size the config has small, sub-configs too (passed to the
    constructor, not set afterwards, so that derived fields such as layer types follow); sizes named in
    `kept` stay at the default, and a sub-config's stages named there are derived again from its layers."""
    out: dict = {}
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            layers = getattr(value, "num_hidden_layers", None)
            known = {
                k: v
                for k, v in value.to_dict().items()
                if not (isinstance(v, list) and len(v) == layers) and k not in kept & STAGES
            }
            out[key] = {**known, **tiny_overrides(value, kept)}  # per-layer lists are derived again
        elif key in kept:
            continue
        elif key in TINY and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = TINY[key]
        elif key == "image_size" and isinstance(value, (list, tuple)):  # (height, width): YOLOS
            out[key] = [TINY["image_size"]] * len(value)
        elif key in ("num_heads", "depths") and isinstance(value, (list, tuple)) and value:
            out[key] = [4 if key == "num_heads" else 1] * len(value)  # hierarchical models (Swin): per stage
        elif key.endswith("token_id") and isinstance(value, int) and value >= TINY["vocab_size"]:
            out[key] = 2  # special tokens must fit the small vocabulary
    return out


def shrink(config: PretrainedConfig, kept: frozenset = frozenset()) -> PretrainedConfig:
    """A small config of the same type (see tiny_overrides)."""
    return type(config)(**tiny_overrides(config, kept))


def model_class(config: PretrainedConfig) -> type | None:
    """The class to build: a causal or seq2seq LM, the base model, else any task head the auto mappings have."""
    names = ["MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", "MODEL_MAPPING"]
    names += sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING"))
    for name in names:
        try:
            return getattr(modeling_auto, name)[type(config)]
        except (KeyError, ValueError, ImportError, AttributeError, TypeError):
            continue
    return getattr(transformers, type(config).__name__.replace("Config", "Model"), None)  # sub-models


class Timeout(BaseException):
    """A type's time is up: a BaseException, so no `except Exception` in the code under test swallows it."""


@contextlib.contextmanager
def deadline(seconds: int):
    def expire(*_):
        raise Timeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(model: nn.Module, inputs: dict):
    torch.manual_seed(0)  # models that draw noise in forward (ViTMAE's masking) draw the same each time
    with torch.no_grad():
        return model(**inputs)


def first(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state", "image_embeds", "text_embeds"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return next(
        t
        for t in tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
        if isinstance(t, torch.Tensor)
    )


def attention_like(model: nn.Module) -> bool:
    """Whether a module's class name says attention and it owns a projection (Linear, Conv1D, a 1x1
    convolution, ...) or parameter tensors of two or more dimensions itself (XLNet's q, k, v, o)."""
    return any(
        "attention" in type(m).__name__.lower()
        and (
            any(p.dim() >= 2 for p in m.parameters(recurse=False))
            or any(
                isinstance(getattr(c, "weight", None), torch.Tensor)
                and c.weight.dim() >= 2
                and all(size == 1 for size in c.weight.shape[2:])
                for c in m.children()
            )
        )
        for m in model.modules()
    )


def plan_for(layer: ph.AttentionLayer, groups: int) -> list[int]:
    """`groups` whole KV groups (never every one), or `groups` query heads of a single-group layer."""
    if layer.num_kv_heads == 1:
        return list(layer.heads[: min(groups, layer.num_heads - 1)])
    size = layer.group_size
    chosen = list(range(min(groups, max(layer.num_kv_heads - 1, 1))))
    return [h for g in chosen for h in range(g * size, (g + 1) * size)]


def build(model_type: str) -> tuple[nn.Module, dict] | str:
    """The tiny model and its inputs from the first rung of LADDER that builds and runs, or why none did (the
    first rung's reason)."""
    reasons = []
    for kept, tokens in LADDER:
        try:
            built = build_one(model_type, kept, tokens)
        except Timeout:
            raise
        except Exception as error:
            built = reason(error)
        if not isinstance(built, str):
            return built
        if built != NO_PATTERN:
            reasons.append(built)
        if built == "no auto model class":
            break
    return reasons[0]


NO_PATTERN = "no layer pattern to keep"


def patterned(config: PretrainedConfig) -> bool:
    """Whether the config lays its layers out in a pattern (a list with one entry per layer: layer types,
    hybrid blocks): then the default depth keeps the pattern (Zamba's shared block at several depths)."""
    depth = next((getattr(config, k) for k in LAYER_COUNTS if isinstance(getattr(config, k, None), int)), None)
    properties = [k for k, v in vars(type(config)).items() if isinstance(v, property)]  # Jamba's layers_block_type
    values = list(vars(config).values())
    for name in properties:
        with contextlib.suppress(Exception):  # a property may refuse to be read
            values.append(getattr(config, name))
    return any(isinstance(v, (list, tuple)) and len(v) == depth and depth > 2 for v in values)


def build_one(model_type: str, kept: frozenset, tokens: int) -> tuple[nn.Module, dict] | str:
    """The model of one rung and its inputs (it raises if either fails), or why there is none."""
    default = CONFIG_MAPPING[model_type]()
    if kept & LAYER_COUNTS and not patterned(default):
        return NO_PATTERN
    config = shrink(default, kept)
    config._attn_implementation = "eager"
    cls = model_class(config)
    if cls is None:
        return "no auto model class"
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > PARAMETER_CAP:
        return f"{size / 1e6:.0f}M parameters after shrinking"
    torch.manual_seed(0)
    model = cls(config).eval()
    inputs = dummy_inputs(model, batch_size=2, seq_len=tokens)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    try:
        run(model, inputs)
    except Exception:
        if "pixel_values" not in inputs or "input_ids" not in inputs:
            raise
        inputs.pop("pixel_values")  # a multimodal model wants image tokens with pixels: its text part alone
        run(model, inputs)
    return model, inputs


def _user_config(config_class: str, model_class: str, backbone: bool = False, **sizes) -> Callable:
    """A builder of a model configured as a user wrote it (eager attention, seed 0, initializer_range 0.1)."""

    def build_it() -> tuple[nn.Module, dict]:
        config = getattr(transformers, config_class)(initializer_range=0.1, **sizes)
        if backbone:
            config.backbone_config.initializer_range = 0.1
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = getattr(transformers, model_class)._from_config(config).eval()
        inputs = dummy_inputs(model, batch_size=2, seq_len=16)
        if "use_cache" in inspect.signature(model.forward).parameters:
            inputs["use_cache"] = False
        return model, inputs

    return build_it


_ZAMBA = dict(  # Zamba and Zamba2 as the issue built them: one shared attention block
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_head_dim=16,
    intermediate_size=128,
    vocab_size=128,
)
# models built the way users configured them when a sweep by another builder found them wrong (issue 30)
USER_CONFIGS = {
    "d_fine (user)": _user_config(
        "DFineConfig",
        "DFineModel",
        backbone=True,
        d_model=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        head_dim=16,
    ),
    "zamba (user)": _user_config("ZambaConfig", "ZambaForCausalLM", **_ZAMBA),
    "zamba2 (user)": _user_config("Zamba2Config", "Zamba2ForCausalLM", **_ZAMBA),
    "xlnet (user)": _user_config("XLNetConfig", "XLNetLMHeadModel", d_model=64, n_head=4, n_layer=2, vocab_size=128),
}


def reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]


def classify(model_type: str, seconds: int) -> tuple[str, str]:
    try:
        with deadline(seconds):
            built = USER_CONFIGS[model_type]() if model_type in USER_CONFIGS else build(model_type)
    except Exception as error:
        return "not built", reason(error)
    if isinstance(built, str):
        return "not built", built
    model, inputs = built
    try:
        with deadline(seconds):
            return check(model, inputs)
    except Timeout as error:  # slow, not broken: a shared machine or a slow CPU path (Falcon-H1's Mamba)
        return "timeout", f"{error}: run it again alone with more --seconds"


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=atol)


def gated_output(model: nn.Module, targets: dict[str, list[int]], inputs: dict) -> torch.Tensor:
    """The model's output with the targets' heads gated off."""
    by_name = {l.name: l for l in ph.find_attention(model)}
    with ph.head_gates(model) as gates:
        for name, heads in targets.items():
            for h in heads:
                gates[by_name[name].index].data[h] = 0.0
        return first(run(model, inputs))


def moves_with_threads(model: nn.Module, targets: dict[str, list[int]], inputs: dict) -> float:
    """How far the gated model's own output moves between 1 thread and the current count: float rounding
    made visible by a discontinuity downstream."""
    threads = torch.get_num_threads()
    base = gated_output(model, targets, inputs)
    torch.set_num_threads(1)
    try:
        single = gated_output(model, targets, inputs)
    finally:
        torch.set_num_threads(threads)
    return float((base - single).abs().max()) if base.shape == single.shape else float("inf")


def layers_match(model: nn.Module, originals: dict[str, nn.Module], targets: dict, inputs: dict) -> bool:
    """Whether every pruned layer, called inside the pruned model, gives what the original layer gives with the
    targets' heads gated off on the same inputs."""
    by_name = {l.name: l for l in ph.find_attention(model)}
    outcomes: list[bool] = []

    def compare(name: str):
        original = originals[name]
        spec, heads = by_name[name].spec, by_name[name].original_num_heads

        def hook(module, args, kwargs, output):
            kept = torch.tensor([0.0 if h in targets[name] else 1.0 for h in range(heads)])
            o_proj = resolve(original, spec.o)
            gate = gate_hook([kept], 0, by_name[name].head_dim)
            with torch.no_grad(), hooks([(o_proj, "forward_pre", gate)]):
                expected = first(original(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
            got = first(output)
            outcomes.append(close(got, expected, 1e-4 * max(float(expected.abs().max()), 1.0)))

        return hook

    with hooks([(by_name[n].module, "forward", compare(n)) for n in targets], with_kwargs=True):
        run(model, inputs)
    return bool(outcomes) and all(outcomes)


def check(model: nn.Module, inputs: dict) -> tuple[str, str]:
    try:
        layers = ph.find_attention(model)
    except ph.UnsupportedModelError as error:
        return "refused", str(error).splitlines()[0][:160]
    except Exception as error:
        return "crash", f"find_attention: {type(error).__name__}: {error}"[:160]
    if not layers:
        return ("not found", "attention modules, none listed") if attention_like(model) else ("no attention", "")
    called: list[str] = []
    with hooks((l.module, "forward_pre", lambda m, a, n=l.name: called.append(n)) for l in layers):
        run(model, inputs)
    ran = [l for l in layers if l.name in called]
    if not ran:
        return "not run", "random inputs reach no listed attention layer"
    targets = {ran[0].name: plan_for(ran[0], 1)}
    if len(ran) > 1:
        targets[ran[-1].name] = plan_for(ran[-1], 2)
    unpruned = copy.deepcopy(model)
    originals = {name: copy.deepcopy(l.module) for name, l in ((l.name, l) for l in ran) if name in targets}
    expected = gated_output(model, targets, inputs)
    before = parameters(model)
    try:
        ph.prune(model, targets, inputs=inputs)
    except (ph.PlanError, ph.UnsupportedModelError) as error:
        return "refused", str(error).splitlines()[0][:160]
    except Exception as error:
        return "crash", f"prune: {type(error).__name__}: {error}"[:160]
    try:
        got = first(run(model, inputs))
    except Exception as error:
        return "crash", f"forward after prune: {type(error).__name__}: {error}"[:160]
    pruned = parameters(model)
    if pruned >= before:
        return "wrong", f"pruning left {pruned:,} parameters of {before:,}"
    outcome, why = "exact", ""
    if not close(got, expected, 1e-4):
        if not layers_match(model, originals, targets, inputs):
            return "wrong", "a pruned layer differs from the gated original on its own inputs"
        moved = moves_with_threads(unpruned, targets, inputs)
        if moved <= 1e-4:
            return "wrong", "pruned output differs from the gated one"
        outcome = "unstable"
        why = f"the gated model's own output moves by {moved:.3g} between 1 and {torch.get_num_threads()} threads"
    with tempfile.TemporaryDirectory() as folder:
        try:
            ph.save_pruned(model, f"{folder}/m")
            loaded = ph.load_pruned(f"{folder}/m", attn_implementation="eager").eval()
            again = first(run(loaded, inputs))
        except Exception as error:
            return "crash", f"save/load: {type(error).__name__}: {error}"[:160]
    if parameters(loaded) != pruned:
        return "wrong", f"the reloaded model has {parameters(loaded):,} parameters, the pruned one {pruned:,}"
    if not close(again, got, 1e-5):
        return "wrong", "reloaded output differs"
    return outcome, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--json", default=None, help="write every type's outcome here")
    parser.add_argument("--seconds", type=int, default=60, help="time limit per type and stage")
    parser.add_argument("--memory-gib", type=float, default=8, help="address-space limit of the sweep")
    args = parser.parse_args()
    limit = int(args.memory_gib * 2**30)  # a rung whose default sizes outgrow it fails, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    types = args.types.split(",") if args.types else [*sorted(CONFIG_MAPPING.keys()), *USER_CONFIGS]
    results: dict[str, tuple[str, str]] = {}
    start = time.time()
    for i, model_type in enumerate(types):
        try:
            results[model_type] = classify(model_type, args.seconds)
        except Exception as error:  # the harness itself: never stop the sweep
            results[model_type] = ("not built", f"harness: {type(error).__name__}: {error}"[:160])
        print(
            f"[{i + 1}/{len(types)}] {model_type}: {' - '.join(filter(None, results[model_type]))}",
            file=sys.stderr,
            flush=True,
        )
    counts = collections.Counter(outcome for outcome, _ in results.values())
    print(
        f"\ntransformers {transformers.__version__}, torch {torch.__version__}: {len(types)} model types, "
        f"{time.time() - start:.0f} s\n"
    )
    print("| outcome | types |\n|---|---|")
    for outcome in (
        "exact",
        "unstable",
        "refused",
        "wrong",
        "crash",
        "timeout",
        "not found",
        "no attention",
        "not run",
        "not built",
    ):
        names = sorted(t for t, (o, _) in results.items() if o == outcome)
        shown = ", ".join(names) if outcome in ("unstable", "wrong", "crash", "timeout", "not found") else ""
        print(f"| {outcome} | {counts[outcome]}{': ' + shown if shown else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
