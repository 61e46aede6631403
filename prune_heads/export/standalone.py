"""Checkpoints that load without prune_heads: `from_pretrained(path, trust_remote_code=True)`.

The folder gets a small modeling file whose classes subclass the model's own transformers class and
re-apply the recorded surgery after building it, plus prune_heads' surgery modules (families, layers,
surgery) copied beside it, so transformers' remote-code loader finds everything in the checkpoint.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import transformers
from torch import nn
from transformers.models.auto import modeling_auto

from ..errors import PruneHeadsError

MODELING_FILE = "modeling_prune_heads.py"
_RUNTIME = ("errors", "model/families", "model/layers", "model/surgery")  # what the surgery needs, in import order
_MODELING = '''"""Loads this checkpoint, pruned by prune-heads, with plain transformers:
AutoModel*.from_pretrained(path, trust_remote_code=True). The prune_heads_*.py files beside it are
prune-heads' own surgery code; the removed heads are listed in config.json under "prune_heads"."""

import transformers

from .prune_heads_surgery import RECORD_KEY, reapply_record


class {name}(transformers.{base}):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        reapply_record(self, getattr(config, RECORD_KEY, None))

    @classmethod
    def is_custom_code(cls) -> bool:
        return False  # transformers' own modeling with heads removed: its checkpoint key renamings apply
'''


def auto_classes(model: nn.Module) -> list[str]:
    """The transformers Auto classes that map this model's config type to this model's class."""
    config: Any = model.config
    model_type, class_name = config.model_type, type(model).__name__
    found = []
    for name in dir(modeling_auto):
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        if not name.startswith("AutoModel") or mapping is None:
            continue
        names = getattr(mapping, "_model_mapping", {}).get(model_type)
        if class_name == names or (isinstance(names, (tuple, list)) and class_name in names):
            found.append(name)
    return found


def standalone_config(model: nn.Module) -> Any:
    """A copy of the model's config with an `auto_map` that points every matching Auto class at the
    modeling file that `write_code` writes."""
    autos = auto_classes(model) if hasattr(transformers, type(model).__name__) else []
    config: Any = copy.deepcopy(model.config)
    if not autos:
        raise PruneHeadsError(
            f"no transformers Auto class loads {type(model).__name__} (model_type "
            f"{config.model_type!r}); save without standalone=True and load with ph.load_pruned"
        )
    config.auto_map = {auto: f"{Path(MODELING_FILE).stem}.{type(model).__name__}" for auto in autos}
    return config


def write_code(model: nn.Module, folder: Path) -> None:
    """Write the modeling file and the surgery modules it imports into `folder`."""
    base = type(model).__name__
    # the same class name as transformers' own: weight renamings (GPT-NeoX's embed_out) are keyed by it
    (Path(folder) / MODELING_FILE).write_text(_MODELING.format(name=base, base=base))
    package = Path(__file__).parents[1]
    local = "|".join(Path(module).name for module in _RUNTIME)
    for module in _RUNTIME:
        source = (package / f"{module}.py").read_text()
        source = re.sub(rf"^from \.\.?({local}) import", r"from .prune_heads_\1 import", source, flags=re.M)
        (Path(folder) / f"prune_heads_{Path(module).name}.py").write_text(source)
