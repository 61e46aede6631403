"""Writes docs/images/analysis-*.png, the pictures docs/analyze.md shows: the heads page of the LLM demo's model
(SmolLM2-135M from the GGUF the set-up installs, on the 160 shipped sentences the demo calibrates on), each figure
cut out of the page exactly as a browser shows it, and prints the numbers the page quotes.

Run: .venv/bin/python docs/make_analysis_pictures.py   (about 3 minutes on 2 CPU cores)
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from prune_heads.evaluation.analysis import analyze
from prune_heads.evaluation.analysis.page import page
from prune_heads.pipeline import load_model, load_processor, task_data
from prune_heads.recipes import load_recipe

IMAGES = Path(__file__).resolve().parent / "images"
NAMES = ["importance", "intervals", "redundancy", "kv-heads", "behaviour", "cost"]  # the page's figures, in order


def main() -> None:
    recipe = load_recipe("demo-smollm2-gguf")
    model = load_model(recipe)
    data = task_data(recipe, model, load_processor(recipe), recipe.data.score_split, None)
    found = analyze(model, data)
    pictures = re.findall(r'src="data:image/png;base64,([^"]+)"', page(found))
    assert len(pictures) == len(NAMES), len(pictures)
    IMAGES.mkdir(exist_ok=True)
    for name, picture in zip(NAMES, pictures):
        (IMAGES / f"analysis-{name}.png").write_bytes(base64.b64decode(picture))
    print(f"{found.examples} examples, {found.passes:.2f} fisher passes, ranking agreement {found.rank_agreement:.2f}")
    print(f"{len(found.duplicates)} near-duplicate pairs:", [(p.layer, p.a, p.b, p.kind) for p in found.duplicates])
    for cost in found.costs:
        print(
            f"{cost.units} {found.unit}s ({cost.heads} heads): {cost.divergence:.4f} [{cost.low:.4f}, {cost.high:.4f}]"
        )


if __name__ == "__main__":
    main()
