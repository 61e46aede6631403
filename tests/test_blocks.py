import pytest
import tiny_models as tm
import torch

from prune_heads.model.blocks import Resume, block_chain
from prune_heads.model.layers import find_attention
from prune_heads.model.onload import held
from prune_heads.recovery.gated import GatedModel

DECODERS = [n for n, spec in tm.FAMILIES.items() if spec[3] == "decoder"]


def test_the_chain_is_the_one_list_of_blocks_that_holds_every_attention_layer():
    model = tm.build("llama")
    blocks, index = block_chain(model, find_attention(model))
    assert blocks is model.model.layers and index == [0, 1, 2]
    model = tm.build("gpt2")
    assert block_chain(model, find_attention(model))[0] is model.transformer.h
    model = tm.build("bart")  # an encoder's and a decoder's blocks: no one chain
    assert block_chain(model, find_attention(model)) is None


def _resumed(name: str):
    """The tiny model gated with one head off in its last block, its batches, and passes whole and resumed
    there (`Resume` over the gated model)."""
    model = tm.build(name)
    layers = find_attention(model)
    blocks, index = block_chain(model, layers)
    gated = GatedModel(model, layers).__enter__()
    gated.use({layers[-1].name: [layers[-1].heads[0]]})
    batches = [tm.make_inputs(name, batch=2, seq=6, seed=s) for s in range(3)]
    resume = Resume(blocks, batches, gated)

    def whole() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([gated(b).logits for b in batches])

    def resumed() -> torch.Tensor:
        resume.start(index[-1], ((),) * index[-1])
        with resume.replaying(), torch.no_grad():
            return torch.cat([gated(b).logits for b in batches])

    return gated, blocks, resume, whole, resumed


@pytest.mark.parametrize("name", DECODERS)
def test_a_pass_started_at_a_block_gives_the_whole_pass_bit_for_bit(name):
    gated, blocks, resume, whole, resumed = _resumed(name)
    expected = whole()
    assert torch.equal(resumed(), expected) and torch.equal(resumed(), expected)
    assert resume.ran == [1] * (len(blocks) - 1) + [0]  # the blocks before the last ran once, to keep outputs
    assert all("forward" not in block.__dict__ for block in blocks)  # each block's own forward is back
    assert resume.proven(whole, resumed)
    gated.__exit__(None, None, None)


def test_going_on_from_kept_outputs_runs_only_the_blocks_between_and_a_changed_block_starts_again():
    gated, blocks, resume, whole, _ = _resumed("llama")
    resume.start(1, ((),))
    resume.start(2, ((), ()))  # from block 1's kept input: block 1 only
    assert resume.ran == [1, 1, 0]
    resume.start(2, (("changed",), ()))  # block 0 in another state: from the start again
    assert resume.ran == [2, 2, 0]
    resume.start(1, (("changed",),))  # before the kept block: from the start again
    assert resume.ran == [3, 2, 0]
    gated.__exit__(None, None, None)


def test_a_block_that_changes_what_it_was_given_is_not_proven():
    gated, blocks, resume, whole, resumed = _resumed("llama")
    last = blocks[-1]
    plain = last.forward

    def changing(hidden_states, *args, **kwargs):
        out = plain(hidden_states, *args, **kwargs)
        hidden_states.add_(1.0)  # the kept outputs would be another model's the second time
        return out

    last.forward = changing
    assert not resume.proven(whole, resumed)
    assert resume.kept == [] and resume.state == ()
    gated.__exit__(None, None, None)


def test_held_blocks_run_layer_major_one_block_at_a_time_and_a_resumed_pass_is_the_whole_one():
    gated, blocks, _, whole, _ = _resumed("llama")
    order = []
    for i, block in enumerate(blocks):  # a replayed block's own hooks still run: watch what it holds
        block.self_attn.register_forward_hook(lambda module, args, out, i=i: order.append(i))
    resume = Resume(blocks, [tm.make_inputs("llama", batch=2, seq=6, seed=s) for s in range(3)], gated, held)
    expected = whole()
    order.clear()
    with resume.resumed(), torch.no_grad():
        found = torch.cat([gated(b).logits for b in resume.batches])
    assert torch.equal(found, expected)
    assert order == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every batch through a block before the next
    assert resume.state == () and resume.ran == [0, 0, 0]  # a resumed pass keeps nothing
    resume.start(2, ((), ()))
    assert resume.ran == [1, 1, 0]  # held: one block per pass over the batches
    gated.__exit__(None, None, None)
