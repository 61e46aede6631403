"""`ph.prune_model`'s default path on a tiny model, as each data-parallel process runs it (torchrun or
accelerate launch starts it; alone it is the single process): the first process saves the plan, the pruned
weights and the report's decisions to the path given. Arguments: the tiny family, that path, and the
calibration examples (40 unless given) and the tokens it heals on (none unless given). A language model's saved
record holds text it writes before pruning, each process writing its share of the rows."""

from __future__ import annotations

import sys

import torch

import prune_heads as ph
from prune_heads.recovery.generated import written_batches
from prune_heads.runtime import parallel
from prune_heads.runtime.parallel import is_main

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import tiny_models as tm  # noqa: E402


def main(name: str, out: str, examples: int = 40, heal: int = 0) -> None:
    torch.set_num_threads(1)
    parallel.CHUNK = 100  # summed across processes in many chunks, as a big model's statistics are
    batches = tm.batches(name, n=examples // 4) if examples >= 4 else [tm.make_inputs(name, batch=examples, seq=9)]
    if name == "llama":  # a language model calibrates on its own next tokens
        batches = [dict(b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)) for b in batches]
    model = tm.sensitive(tm.build(name)) if name == "bert" else tm.build(name)  # decisions above float noise
    written = written_batches(model, 5, 2, 9, 0, progress=False) if name == "llama" else []
    result = ph.prune_model(model, batches, ph.PruneConfig(recovery=ph.RecoveryConfig(heal=heal)), progress=False)
    if is_main():
        found = {"plan": result.plan, "weights": model.state_dict(), "recovery": result.recovery}
        torch.save({**found, "written": [b["input_ids"] for b in written]}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
