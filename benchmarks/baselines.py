"""Published retraining-free baselines for decoder LLMs, as their papers describe them, composed from
prune_heads' pieces (benchmarks only: the package's default path is `ph.prune_model`)."""

from __future__ import annotations

import torch

import prune_heads as ph
from prune_heads.model.hooks import hooks
from prune_heads.recovery.gated import GatedModel
from prune_heads.runtime.devices import input_device, to_device
from prune_heads.scoring.methods import fluctuation, head_scores
from prune_heads.scoring.objective import Objective
from prune_heads.scoring.recording import record
from prune_heads.task_data import without_labels


def flap(model, batches: list[dict], num_heads: int, gqa: str = "groups") -> dict:
    """FLAP (An et al. 2024): per head, the fluctuation of its output-projection input channels (variance over
    the calibration tokens x squared column norms), standardised within each layer; the lowest removed
    globally; then bias compensation: the removed channels' mean contribution added to the output bias (a
    bias is added where the model has none). One forward pass, no gradients."""
    device = input_device(model)
    batches = [to_device(without_labels(b), device) for b in batches]
    layers = ph.find_attention(model)
    recorder = record(model, batches, Objective(model))
    scores = head_scores(
        "fluctuation", layers, fluctuation(layers, recorder.variances(), gqa == "groups"), len(batches)
    )
    plan = ph.select_heads(scores, num_heads=num_heads, gqa=gqa)
    gated = GatedModel(model, layers)
    gated.use(plan, gated.compensation(plan, recorder.means()))
    gated.fold(plan)
    return plan


@torch.no_grad()
def layer_drop(model, batches: list[dict], num_heads: int) -> dict:
    """Attention drop (He et al. 2024, "What Matters in Transformers? Not All Attention is Needed"): remove the
    attention blocks whose output is most similar to their input, the cosine between the residual stream
    before and after the attention sublayer averaged over the calibration tokens."""
    layers = ph.find_attention(model)
    similarity = torch.zeros(len(layers), dtype=torch.float64)
    tokens = torch.zeros(len(layers))
    inputs: dict[int, torch.Tensor] = {}

    def before(i):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def after(i, mask):
        def hook(module, args, kwargs, out):
            x = inputs[i]
            y = x + (out[0] if isinstance(out, tuple) else out)
            cosine = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)  # [batch, seq]
            keep = mask()
            similarity[i] += float(cosine[keep.bool()].double().sum()) if keep is not None else float(cosine.sum())
            tokens[i] += float(keep.sum()) if keep is not None else cosine.numel()

        return hook

    current = {}
    watch = []
    for i, layer in enumerate(layers):
        block = model.get_submodule(layer.name.rpartition(".")[0])  # the decoder layer holding the attention
        watch += [(block, "forward_pre", before(i)), (layer.module, "forward", after(i, lambda: current.get("mask")))]
    with hooks(watch, with_kwargs=True):
        for batch in batches:
            batch = to_device(without_labels(batch), input_device(model))
            current["mask"] = batch.get("attention_mask")
            model(**batch)
    mean = (similarity / tokens.clamp(min=1)).float()
    scores = head_scores(
        "layer-drop", layers, [(1 - m).expand(l.num_heads).clone() for l, m in zip(layers, mean)], len(batches)
    )
    plan = ph.select_heads(scores, num_heads=num_heads, granularity="layer")
    ph.prune(model, plan)
    return plan
