"""Export: where a pruned model goes.

`persistence` (`save_pruned` / `load_pruned`, folders that are never half-written), `standalone`
(checkpoints that load without prune-heads), `gguf` (one GGUF file for llama.cpp) and `hub` (a model card
and one Hub commit).
"""

from .gguf import GgufError, check_gguf, save_gguf
from .hub import model_card, push_pruned
from .persistence import ModelNotFoundError, OutputExistsError, load_pruned, save_pruned

__all__ = [
    "check_gguf",
    "GgufError",
    "load_pruned",
    "model_card",
    "ModelNotFoundError",
    "OutputExistsError",
    "push_pruned",
    "save_gguf",
    "save_pruned",
]
