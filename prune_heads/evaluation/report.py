"""Reports: before/after comparison as JSON and Markdown, and PNG plots a person can read."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..config import size_text
from ..runtime.ledger import Stage
from ..scoring.head_scores import HeadScores
from .analysis.page import write_page
from .analysis.records import Analysis
from .confidence import RESAMPLES, describe
from .figures import pyplot, short_name


def heatmap(scores: HeadScores, path: Path, removed: dict[str, list[int]], title: str | None = None) -> Path:
    """Layers x heads importance heatmap; removed heads crossed out, absent heads left blank."""
    plt = pyplot()
    grid = scores.matrix().numpy()
    rows, cols = grid.shape
    fig, ax = plt.subplots(figsize=(max(5, 0.45 * cols + 2.5), max(2.5, 0.32 * rows + 1.5)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"importance ({scores.method})")
    for row, name in enumerate(scores.layers):
        for head in removed.get(name, []):
            ax.plot(head, row, marker="x", color="red", markersize=8, markeredgewidth=2)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.set_yticklabels([short_name(n) for n in scores.layers], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("attention layer")
    kept = sum(len(h) for h in scores.heads.values()) - sum(len(h) for h in removed.values())
    ax.set_title(
        title or f"Head importance ({scores.method}, {scores.num_examples} examples); x = removed, {kept} heads kept",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@dataclass
class Report:
    """Before/after measurements of one pruning run, with what was removed and why.

    `before` and `after` are `measure` results: {"metrics": {...}, "speed": {...}, "heads": {layer: kept}}.
    """

    before: dict
    after: dict
    plan: dict[str, list[int]] = field(default_factory=dict)
    scores: HeadScores | None = None
    history: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    recovery: list[dict] = field(default_factory=list)
    changes: dict[str, dict] = field(default_factory=dict)  # metric -> paired interval (prune_heads.confidence)
    analysis: Analysis | None = None  # the unpruned model's heads (`analyze`), drawn with the removed ones marked

    def summary(self) -> dict[str, Any]:
        """Derived numbers: metric deltas (with their paired 95% interval, McNemar p for accuracies, and whether
        the change is within noise), speed-up, the FLOPs ceiling and how close to it the speed-up is."""
        out: dict[str, Any] = {"metrics": {}}
        before, after = self.before.get("metrics", {}), self.after.get("metrics", {})
        for key, value in before.items():
            new = after.get(key)
            if (
                isinstance(value, (int, float))
                and isinstance(new, (int, float))
                and key not in ("examples", "tokens")
                and not key.endswith("_stderr")
            ):
                change = {k: v for k, v in self.changes.get(key, {}).items() if k not in ("delta", "examples")}
                errors = {
                    f"stderr_{when}": found[f"{key}_stderr"]
                    for when, found in (("before", before), ("after", after))
                    if isinstance(found.get(f"{key}_stderr"), (int, float))
                }
                out["metrics"][key] = {"before": value, "after": new, "delta": new - value, **errors, **change}
        sb, sa = self.before.get("speed", {}), self.after.get("speed", {})
        if sb and sa:
            speedup = sb["latency_ms"] / sa["latency_ms"]
            ceiling = sb["flops"] / sa["flops"] if sa["flops"] else float("inf")
            out["speed"] = {
                "speedup": speedup,
                "flops_ceiling": ceiling,
                "fraction_of_ceiling": (speedup - 1) / (ceiling - 1) if ceiling > 1 else None,
                "parameters_ratio": sa["parameters"] / sb["parameters"],
                "flops_ratio": sa["flops"] / sb["flops"],
            }
        heads_before = sum(self.before.get("heads", {}).values())
        heads_after = sum(self.after.get("heads", {}).values())
        out["heads"] = {"before": heads_before, "after": heads_after, "removed": heads_before - heads_after}
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready."""
        return {
            "meta": self.meta,
            "summary": self.summary(),
            "before": self.before,
            "after": self.after,
            "plan": self.plan,
            "history": self.history,
            "recovery": self.recovery,
            "changes": self.changes,
            "scores": self.scores.to_dict() if self.scores is not None else None,
        }

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """Read a report.json written by `write`."""
        data = json.loads(Path(path).read_text())
        scores = HeadScores.from_dict(data["scores"]) if data.get("scores") else None
        return cls(
            before=data["before"],
            after=data["after"],
            plan=data.get("plan", {}),
            scores=scores,
            history=data.get("history", []),
            meta=data.get("meta", {}),
            recovery=data.get("recovery", []),
            changes=data.get("changes", {}),
        )

    def markdown(self) -> str:
        """A summary a person reads: metric, delta, speed-up, parameters, FLOPs, heads kept per layer."""
        s = self.summary()
        lines = [f"# Pruning report: {self.meta.get('model', '')}", ""]
        if self.meta:
            hidden = ("model", "heldout", "timings", "work", "frontier")
            lines += [", ".join(f"{k}: {v}" for k, v in self.meta.items() if k not in hidden), ""]
        lines += ["| | before | after | change |", "|---|---|---|---|"]
        for key, m in s["metrics"].items():
            change = describe(self.changes[key]) if key in self.changes else f"{m['delta']:+.4f}"
            cells = [
                f"{m[when]:.4f}" + (f" ± {m[f'stderr_{when}']:.4f}" if f"stderr_{when}" in m else "")
                for when in ("before", "after")
            ]
            lines.append(f"| {key} | {cells[0]} | {cells[1]} | {change} |")
        lines.append(f"| attention heads | {s['heads']['before']} | {s['heads']['after']} | -{s['heads']['removed']} |")
        lines += self._speed_lines(s.get("speed"))
        lines += self._changes_lines()
        lines += self._recovery_lines()
        if "frontier" in self.meta:
            lines += ["", *frontier_table(self.meta["frontier"])]
        if self.analysis is not None:
            lines += ["", f"The heads, which matter and which repeat each other: [analysis.html](analysis.html) "
                      f"({len(self.analysis.duplicates)} near-duplicate pairs; the removed heads marked)."]  # fmt: skip
        lines += ["", "| layer | heads kept |", "|---|---|"]
        for name, kept in self.after.get("heads", {}).items():
            lines.append(f"| {name} | {kept} / {self.before['heads'].get(name, kept)} |")
        return "\n".join(lines) + "\n"

    def _speed_lines(self, sp: dict | None) -> list[str]:
        """Rows of the table for size and speed before and after, and the FLOPs ceiling below it."""
        sb, sa = self.before.get("speed", {}), self.after.get("speed", {})
        if not (sb and sa and sp):
            return []
        lines = [
            f"| parameters | {sb['parameters']:,} | {sa['parameters']:,} | x{sp['parameters_ratio']:.3f} |",
            f"| GFLOPs per forward | {sb['flops'] / 1e9:.2f} | {sa['flops'] / 1e9:.2f} | x{sp['flops_ratio']:.3f} |",
            f"| latency median (ms) | {sb['latency_ms']:.1f} | {sa['latency_ms']:.1f} | {sp['speedup']:.2f}x faster |",
            f"| latency p90 (ms) | {sb['latency_p90_ms']:.1f} | {sa['latency_p90_ms']:.1f} | |",
            f"| examples/s | {sb['examples_per_s']:.1f} | {sa['examples_per_s']:.1f} | |",
            f"| peak memory (MB) | {sb['peak_memory_bytes'] / 2**20:.1f} | {sa['peak_memory_bytes'] / 2**20:.1f} | |",
        ]
        for gb, ga in zip(sb.get("generation", []), sa.get("generation", [])):
            where = f"batch {gb['batch_size']}, {gb['new_tokens']} new tokens"
            tokens_before, tokens_after = gb["generate_tokens_per_s"], ga["generate_tokens_per_s"]
            cache_before, cache_after = gb["kv_cache_bytes"], ga["kv_cache_bytes"]
            lines += [
                f"| generated tokens/s ({where}) | {tokens_before:.1f} | {tokens_after:.1f} | "
                f"x{tokens_after / tokens_before:.2f} |",
                f"| KV cache KB ({where}) | {cache_before / 1024:.1f} | {cache_after / 1024:.1f} | "
                f"x{cache_after / max(cache_before, 1):.3f} |",
            ]
        return lines + [
            "",
            f"FLOPs ceiling: removing these heads can make the forward pass at most {sp['flops_ceiling']:.2f}x "
            f"faster; measured {sp['speedup']:.2f}x ({self._ceiling_note(sp)}). Settings: {sb['settings']}.",
        ]

    def _changes_lines(self) -> list[str]:
        """How the changes' intervals were made."""
        if not self.changes:
            return []
        level = next(iter(self.changes.values()))["level"]
        how = (
            f"Changes are after - before on the same examples, with a paired bootstrap interval ({RESAMPLES} "
            f"resamples, seeded) and, for accuracies, McNemar's exact p-value; 'within noise' when the interval "
            f"holds 0 (and p >= {1 - level:.2g})."
        )
        if any(k.endswith("_stderr") for k in self.before.get("metrics", {})):
            how += " ± is lm-eval's standard error."
        return ["", how]

    def _recovery_lines(self) -> list[str]:
        """What recovery tried and kept, with the held-out divergence from the unpruned model."""
        if not self.recovery:
            return []
        held = self.meta.get("heldout") or {}
        general = held.get("general") or {}
        beside = ""
        if general:
            how = "weighed equally" if general.get("weighed") else "measured beside, not weighed"
            beside = f" and {general['examples']} of {general['source']}, {how}"
        lines = [
            "",
            f"Recovery, decided on {held.get('examples', 0)} held-out calibration examples{beside} "
            f"(divergence from the unpruned model, for embeddings plus that of each example's "
            f"neighbour distribution; lower is better):",
            "",
            "| step | tried | held-out divergence | kept |",
            "|---|---|---|---|",
        ]
        for entry in self.recovery:
            if entry["step"] == "selection":
                for name, value in entry["tried"].items():
                    lines.append(f"| plan | {name} | {_number(value)} | {'yes' if name == entry['kept'] else ''} |")
                for layer, merges in entry.get("shared_kv_heads", {}).items():
                    pairs = ", ".join(f"{j} -> {g}" for j, g in merges.items())
                    lines.append(f"| shared KV heads | {layer}: {pairs} (every query head kept) | | |")
            elif entry["step"] == "notes":
                lines += [f"| note | {note} | | |" for note in entry["notes"]]
            elif entry["step"] == "healing":
                lines.append(_healing_row(entry))
            else:
                by_epoch = " -> ".join(_number(v) for v in entry.get("heldout_by_epoch", []))
                kept = (
                    "no" if not entry.get("kept", True) else "yes, moving average" if entry.get("averaged") else "yes"
                )
                budget = f" of {_tflops(entry['budget_flops'])}" if entry.get("budget_flops") is not None else ""
                lines.append(
                    f"| {entry['step']} | {entry['epochs_run']} epochs, {_tflops(entry.get('flops', 0))}"
                    f"{budget} counted, {entry['seconds']:.1f} s | {by_epoch} | {kept} |"
                )
        work = self.meta.get("work") or {}
        if "calibration_pass" in work:
            lines += ["", _work_line(work)]
        return lines

    @staticmethod
    def _ceiling_note(sp: dict) -> str:
        fraction = sp["fraction_of_ceiling"]
        return "no ceiling to reach" if fraction is None else f"{100 * fraction:.0f}% of the possible gain"

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write report.json, report.md and the PNG plots into `folder`; returns the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"json": folder / "report.json", "markdown": folder / "report.md"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1, default=float))
        paths["markdown"].write_text(self.markdown())
        if self.scores is not None:
            paths["heatmap"] = heatmap(self.scores, folder / "heatmap.png", self.plan)
        paths["heads"] = heads_per_layer(
            self.before.get("heads", {}), self.after.get("heads", {}), folder / "heads_per_layer.png"
        )
        if len(self.history) > 1:
            paths["curve"] = curve(self.history, folder / "curve.png")
        if "frontier" in self.meta:
            paths["frontier"] = frontier_plot(self.meta["frontier"], folder / "frontier.png")
        if self.analysis is not None:
            paths["analysis"] = write_page(self.analysis, folder, self.plan)
        return paths


def frontier_table(frontier: dict[str, Any]) -> list[str]:
    """The report's frontier as Markdown lines: per depth (the first the unpruned model) the units and heads
    gone, the perplexity changes with their intervals, the KV cache per cache type at the frontier's context,
    the parameters and, where measured, llama.cpp's prompt and decode speed per cache type (decode against the
    unpruned model's in f16); a depth measured with KV heads shared in a row of its own under it."""
    depths, context = frontier["depths"], f"{frontier['context']:,} tokens"
    caches = list(depths[0]["kv_cache"])
    timed = list(depths[0].get("llama_cpp", {}))
    head = ["depth", "units removed", "heads removed", "held-out perplexity"]
    head += ["perplexity on the second text"] if frontier.get("second_text") else []
    head += [f"KV cache at {context} ({' / '.join(caches)})", "parameters"]
    head += [f"llama.cpp prompt / decode tok/s at {context}, {cache} cache" for cache in timed]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for d in depths:
        for row in filter(None, (d, d.get("shared"))):
            cells = _depth_row(row, bool(frontier.get("second_text")))
            cells += [
                _speed(row["llama_cpp"][c], depths[0]["llama_cpp"][timed[0]]) if "llama_cpp" in row else "-"
                for c in timed
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _depth_row(d: dict[str, Any], second: bool) -> list[str]:
    """A frontier depth's cells up to its parameters; a shared one's depth says how many KV heads it shares."""
    depth = str(Fraction(d["share"]).limit_denominator(1000)) if d["units"] else "none"
    if d.get("sharing"):
        merged = sum(map(len, d["sharing"].values()))
        depth += f", {merged} KV heads shared in {len(d['sharing'])} layers"
    row = [depth, str(d["units"]), str(d["heads"]), _change(d["perplexity_change"], d["interval"])]
    row += [_change(d["eval_change"], d["eval_interval"])] if second else []
    return row + [" / ".join(size_text(size) for size in d["kv_cache"].values()), f"{d['parameters']:,}"]


def _change(change: float, interval: list[float] | tuple[float, float]) -> str:
    """A relative change with its interval, in percent."""
    return f"{100 * change:+.1f}% ({100 * interval[0]:+.1f} to {100 * interval[1]:+.1f})"


def _speed(speed: dict[str, float], unpruned: dict[str, float]) -> str:
    """Prompt and decode tokens a second, and the decode speed against the unpruned model's."""
    return f"{speed['prompt']:,.0f} / {speed['decode']:,.1f} ({speed['decode'] / unpruned['decode']:.2f}x)"


def _work_line(work: dict[str, float]) -> str:
    """The report's line on counted work: the price of one calibration pass, each stage's work (tuning's with its
    budget where it had one) and their total."""
    stages = []
    for stage in Stage:
        if stage.value in work:
            capped = stage is Stage.TUNING and "tuning_budget" in work
            budget = f" of its {_tflops(work['tuning_budget'])} budget" if capped else ""
            stages.append(f"{stage.label} {_tflops(work[stage.value])}{budget}")
    line = (
        f"Work, counted in FLOPs (the limits never read a clock): one forward and backward pass over the "
        f"calibration batches {_tflops(work['calibration_pass'])}; {'; '.join(stages)}; in all "
        f"{_tflops(work.get('total', 0))}."
    )
    if work.get("offloaded_bytes"):
        moved, offloaded = work["moved_bytes"], work["offloaded_bytes"]
        line += (
            f" Onloading moved {moved / 2**30:.2f} GiB to the device, {moved / offloaded:.1f} times the "
            f"offloaded weights' {offloaded / 2**30:.2f} GiB."
        )
    return line


def _healing_row(entry: dict) -> str:
    """The heal's row: tokens and their sources, and the held-out divergences before -> after it."""
    rows = entry["rows"]
    source = f"{rows['corpus']} corpus" if rows["corpus"] else f"{rows['written']} written"
    held = "; ".join(f"{k} {_number(v['before'])} -> {_number(v['after'])}" for k, v in entry["heldout"].items())
    return (
        f"| healing | {entry['tokens']:,} tokens in {entry['steps']} steps ({rows['calibration']} calibration rows "
        f"x {rows['calibration_repeats']}, {source}), {entry['seconds']:.1f} s | {held} | "
        f"{'yes' if entry['kept'] else 'no'} |"
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.5g}"


def _tflops(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOPs"


def compare(before: dict, after: dict, **extras: Any) -> Report:
    """A Report from two `measure` results; `extras` are Report fields (plan, scores, history, meta,
    recovery)."""
    return Report(before, after, **extras)


def heads_per_layer(before: dict[str, int], after: dict[str, int], path: Path) -> Path:
    """Bar chart of heads kept per layer, over the original count."""
    plt = pyplot()
    names = list(before)
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(names) + 2), 3.2))
    ax.bar(range(len(names)), [before[n] for n in names], color="#dddddd", label="before")
    ax.bar(range(len(names)), [after.get(n, before[n]) for n in names], color="#3b75af", label="kept")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([short_name(n) for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("heads")
    ax.set_title(f"Heads kept per layer: {sum(after.values())} of {sum(before.values())}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curve(history: list[dict], path: Path) -> Path:
    """Metric (and loss) against heads removed, from an iterative pruning history."""
    plt = pyplot()
    removed = [h["heads_removed"] for h in history]
    keys = [k for k in history[0] if k not in ("step", "heads_removed") and isinstance(history[0][k], (int, float))]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * max(len(keys), 1), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot(removed, [h[key] for h in history], marker="o")
        ax.set_xlabel("heads removed")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.suptitle("Iterative pruning", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def frontier_plot(frontier: dict[str, Any], path: Path) -> Path:
    """Quality against speed: each depth's perplexity change (95% interval as a bar) against llama.cpp's decode
    speed in an f16 cache where measured, else against the KV cache (f16) it keeps."""
    plt = pyplot()
    depths = frontier["depths"]
    timed = "llama_cpp" in depths[0] and "f16" in depths[0]["llama_cpp"]
    x = [d["llama_cpp"]["f16"]["decode"] if timed else d["kv_cache"]["f16"] / 2**20 for d in depths]
    series = [("held-out", "perplexity_change", "interval"), ("second text", "eval_change", "eval_interval")]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, change, interval in series[: 2 if frontier.get("second_text") else 1]:
        y = [100 * d[change] for d in depths]
        error = [
            [y_ - 100 * d[interval][0] for y_, d in zip(y, depths)],
            [100 * d[interval][1] - y_ for y_, d in zip(y, depths)],
        ]
        ax.errorbar(x, y, yerr=error, marker="o", capsize=3, label=label)
    for x_, d in zip(x, depths):
        ax.annotate(str(Fraction(d["share"]).limit_denominator(1000)) if d["units"] else "none", (x_, 0), fontsize=8)
    context = f"{frontier['context']:,} tokens"
    ax.set_xlabel(f"llama.cpp decode tok/s at {context}" if timed else f"KV cache MiB at {context} (f16)")
    ax.set_ylabel("perplexity change %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
