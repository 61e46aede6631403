import pytest
import tiny_models as tm
from torch import nn

from prune_heads.runtime.work import Pricer, count_flops, first_example, module_shares


def test_module_shares_are_each_block_s_part_of_the_counted_forward_pass():
    model = tm.build("llama")
    batch = tm.make_inputs("llama", batch=3, seq=8)
    shares = module_shares(model, batch, list(model.model.layers))
    assert shares is not None and len(shares) == 3
    assert shares[0] == pytest.approx(shares[1]) == pytest.approx(shares[2])  # the same blocks
    head = module_shares(model, batch, [model.lm_head])[0]
    assert sum(shares) + head == pytest.approx(1.0)  # nothing else in a Llama multiplies matrices
    one = first_example(batch)
    assert list(one["input_ids"].shape) == [1, 8] and Pricer.of(model, batch).per_position * 8 == count_flops(
        model, one
    )
    assert module_shares(model, batch, [nn.Linear(2, 2)]) is None  # not in the model: cannot be priced
