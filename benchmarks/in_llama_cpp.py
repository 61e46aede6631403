"""Pruned SmolLM2-135M in llama.cpp (CPU, fixed threads): file size, KV cache bytes (llama.cpp's own count),
prompt and decode tokens/s at 512, 2,048 and 8,192 tokens of context, and perplexity in llama.cpp beside
transformers' for the same weights, for the unpruned GGUF and the default path at 1/6, 1/3 and 1/2 of the
KV groups removed (GGUF in, GGUF out: the source's Q4_1 tensors copied, q/k/v sliced).

Each speed-up is printed beside its ceiling, what the removed work allows: the same run also times a file that
keeps only one KV group of its first layer (`attention-free`, llama.cpp cannot run one with no KV cache at all),
so T0, the time of all but attention, is measured: T_ref = T0 + r (T - T0), r its share of the attention work.
A plan that removes a share f of the attention work (counted from the files' head counts: q/k/v/o projections
and the scores and values over the context, `attention_work`) takes at least T0 + (1 - f)(T - T0), so its
speed-up is at most T / (T0 + (1 - f)(T - T0)). (Counted in FLOPs alone, attention would be cheaper than it is
in llama.cpp on the CPU, and the measured speed-ups pass that bound.)

Run: .venv/bin/python benchmarks/in_llama_cpp.py --build   (the pruned files, default path, cached in benchmarks/.gguf;
                                                    about 20 minutes on 2 cores)
     .venv/bin/python benchmarks/in_llama_cpp.py           (the measurements in llama.cpp, about 25 minutes;
                                                    a quiet machine)
     .venv/bin/python benchmarks/in_llama_cpp.py --table   (the table again from the saved runs)
     add --gguf-type Q4_K_M (any `ph.save_gguf` file type) to each: the same files, the unpruned and the
     attention-free one too, written whole in that type by llama.cpp's quantizer (`ph.save_gguf(...,
     tensor_type=...)`) and measured in a run of their own (ratios only within one run); --ratio 1/2 (repeatable)
     builds only those depths (the files of the others built before stay in the table). Their transformers
     perplexity is the float model's, before llama.cpp quantizes.
     --cache-types f16,q8_0,q4_0: every file with llama.cpp's KV cache in each type (its own quantization of
     keys and values, the peer of removing KV groups), speeds against the unpruned file with the same cache
     type and decode at 8,192 tokens against the unpruned file's f16 cache, and llama.cpp's perplexity with
     each (about 12 minutes a cache type for the unpruned and one pruned file).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import time
from pathlib import Path

import gguf
import llama_cpp
from common import FIXTURES, markdown_table
from llama_cpp import Llama
from llm import GGUF, perplexity, smollm2_folder, windows
from transformers import AutoTokenizer

import prune_heads as ph
from prune_heads.export.gguf.speed import GGML_CACHE_TYPES, llama_perplexity, llama_speed

OUT = Path(__file__).resolve().parent / ".gguf"
RATIOS = {"1/6 of KV groups": 45, "1/3 of KV groups": 90, "1/2 of KV groups": 135}
CONTEXTS = (512, 2048, 8192)
CACHE_TYPES = ("f16", "q8_0", "q4_0")  # llama.cpp's KV-cache types measured (--cache-type-k/-v)
THREADS, REPEATS = 2, 3


def _path(stem: str, gguf_type: str | None, extension: str = "gguf") -> Path:
    """Where a file of the run in `gguf_type` (None: the source's types) lives: STEM[-TYPE].EXTENSION."""
    return OUT / f"{stem}{'-' + gguf_type if gguf_type else ''}.{extension}"


def build(gguf_type: str | None = None, ratios: list[str] | None = None) -> None:
    """The default path at each ratio (`ratios`: only those, the files of others built before kept) on the llm.py
    calibration windows, each written as GGUF (the source's tensors copied, or the whole file in `gguf_type`);
    transformers' perplexity of every model on the movie test windows goes beside them (cache.json, or
    cache-TYPE.json)."""
    OUT.mkdir(exist_ok=True)
    folder = smollm2_folder()
    source, tokenizer = (
        ph.load_pruned(folder, gguf_file=GGUF).eval(),
        AutoTokenizer.from_pretrained(folder, gguf_file=GGUF),
    )
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    test = windows(tokenizer, "movie-snippets", "test[:1000]")
    unpruned = source.config.gguf_source
    if gguf_type:
        unpruned = ph.save_gguf(source, _path("smollm2", gguf_type), tensor_type=gguf_type, overwrite=True).path
    saved = _path("cache", gguf_type, "json")
    built = json.loads(saved.read_text()) if ratios and saved.exists() else {}
    cache = {"unpruned": {"file": str(unpruned), "transformers": perplexity(source, test)}}
    for name, heads in RATIOS.items():
        if ratios and not any(name.startswith(r + " ") for r in ratios):
            if name in built:
                cache[name] = built[name]
            continue
        model = ph.load_pruned(folder, gguf_file=GGUF).eval()
        tick = time.perf_counter()
        result = ph.prune_model(
            model, calibration, ph.PruneConfig(selection=ph.SelectionConfig(num_heads=heads)), progress=False
        )
        seconds = time.perf_counter() - tick
        written = ph.save_gguf(model, _path(f"smollm2-{heads}", gguf_type), tensor_type=gguf_type, overwrite=True)
        cache[name] = {
            "file": str(written.path),
            "transformers": perplexity(model, test),
            "seconds": seconds,
            "architecture": written.architecture,
            "written": written.written,
            "kept": [e.get("kept") for e in result.recovery],
        }
        print(name, cache[name], flush=True)
    reference(gguf_type)
    saved.write_text(json.dumps(cache, indent=1))


def reference(gguf_type: str | None = None) -> Path:
    """SmolLM2 with every head removed but the first layer's first KV group (llama.cpp needs a KV cache): the
    time of everything but attention, for the ceilings."""
    model = ph.load_pruned(smollm2_folder(), gguf_file=GGUF).eval()
    layers = ph.find_attention(model)
    ph.prune(model, {l.index: list(l.heads[l.group_size if l.index == 0 else 0 :]) for l in layers})
    return ph.save_gguf(model, _path("smollm2-attention-free", gguf_type), tensor_type=gguf_type, overwrite=True).path


def attention_work(path: Path, context: int) -> tuple[float, float]:
    """Attention FLOPs llama.cpp does for a prompt of `context` tokens and for one decoded token after `context`
    tokens, from the file's per-layer head counts: q/k/v/o projections, and scores and values over the causal
    context (deci's emptied first layer counts its zero n_embd x n_embd product)."""
    fields = gguf.GGUFReader(path).fields
    arch = str(fields["general.architecture"].contents())

    def per_layer(key):
        found = fields[f"{arch}.{key}"].contents()
        return found if isinstance(found, list) else [found] * int(fields[f"{arch}.block_count"].contents())

    width = int(fields[f"{arch}.embedding_length"].contents())
    head_dim = (
        int(fields[f"{arch}.attention.key_length"].contents())
        if f"{arch}.attention.key_length" in fields
        else width // per_layer("attention.head_count")[0]
    )  # llama.cpp's default when the file does not say
    projections = scores = 0
    for heads, kv in zip(per_layer("attention.head_count"), per_layer("attention.head_count_kv")):
        linear = kv == 0 and heads > 0
        projections += 2 * width * (width if linear else head_dim * (2 * heads + 2 * kv))
        scores += 0 if linear else 4 * heads * head_dim  # per attended position
    return projections * context + scores * context * (context + 1) / 2, projections + scores * context


def ceiling(time: float, reference: float, kept: float, removed: float) -> float:
    """The largest speed-up a plan removing the share `removed` of the attention work can give, when the
    unpruned model takes `time` per token and the reference, which keeps the share `kept`, `reference`."""
    floor = (reference - kept * time) / (1 - kept)  # T0: all but attention
    return time / (floor + (1 - removed) * (time - floor))


class LlamaLog:
    """llama.cpp's log lines, kept while the context is created (its own KV cache count is printed there)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.callback = llama_cpp.llama_log_callback(lambda level, text, data: self.lines.append(text.decode()))
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p())

    def kv_bytes(self) -> int:
        line = next(l for l in reversed(self.lines) if "llama_kv_cache: size =" in l)
        return int(float(re.search(r"size =\s*([\d.]+) MiB", line).group(1)) * 2**20)


def _llama(path: Path, cache_type: str, **options) -> Llama:
    """llama.cpp on `path` with THREADS threads, flash attention and the KV cache in `cache_type`."""
    kind = GGML_CACHE_TYPES[cache_type]
    return Llama(model_path=str(path), n_threads=THREADS, flash_attn=True, type_k=kind, type_v=kind, **options)


def speed(path: Path, context: int, log: LlamaLog, ids: list[int], cache_type: str = "f16") -> dict:
    """Prompt and decode tokens/s at `context` tokens (`ph`'s llama.cpp speed run) with the KV cache in
    `cache_type`, and the KV cache's bytes as llama.cpp allocated them."""
    log.lines.clear()
    found = llama_speed(path, ids, context, cache_type, THREADS, verbose=True)
    return {"prompt": found.prompt, "decode": found.decode, "kv": log.kv_bytes()}


def _runs(cache: dict, cache_types: list[str], gguf_type: str | None, table: bool) -> dict:
    """Speed runs of every file with every cache type at every context, REPEATS times in turns (machine noise
    falls on all alike), kept as they come (runs[-TYPE].json); `table`: only those saved."""
    saved = _path("runs", gguf_type, "json")
    runs: dict = {(n, t, c): [] for n in cache for t in cache_types for c in CONTEXTS}
    if table:
        runs.update({(n, t, int(c)): r for n, t, c, r in json.loads(saved.read_text()) if (n, t, int(c)) in runs})
        return runs
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
    lines = (FIXTURES / "movie-snippets" / "train.jsonl").read_text().splitlines()
    ids = tokenizer(" ".join(json.loads(line)["sentence"] for line in lines))["input_ids"][: max(CONTEXTS)]
    log = LlamaLog()
    for _ in range(REPEATS):
        for context in CONTEXTS:
            for name, cache_type in ((n, t) for t in cache_types for n in cache):
                runs[name, cache_type, context].append(speed(Path(cache[name]["file"]), context, log, ids, cache_type))
                print(name, cache_type, context, runs[name, cache_type, context][-1], flush=True)
                saved.write_text(json.dumps([[*k, r] for k, r in runs.items()]))
    return runs


def _speeds(cache: dict, runs: dict, name: str, cache_type: str) -> list[str]:
    """A row's tokens/s cells: each against the unpruned file with the same cache type, beside its ceiling;
    decode at the longest context also against the unpruned file's f16 cache."""
    names, cells = list(cache), []
    for kind in ("prompt", "decode"):
        for context in CONTEXTS:
            rate = {n: statistics.median(r[kind] for r in runs[n, cache_type, context]) for n in (name, *names)}
            done = [
                attention_work(Path(cache[n]["file"]), context)[kind == "decode"] for n in (name, names[-1], names[0])
            ]
            best = ceiling(1 / rate[names[0]], 1 / rate[names[-1]], done[1] / done[2], 1 - done[0] / done[2])
            cells.append(
                f"{rate[name]:.0f}"
                + ("" if name == names[0] else f" ({rate[name] / rate[names[0]]:.2f}x of {best:.2f}x)")
            )
    last = max(CONTEXTS)
    plain = (
        statistics.median(r["decode"] for r in runs[names[0], "f16", last]) if (names[0], "f16", last) in runs else None
    )
    mine = statistics.median(r["decode"] for r in runs[name, cache_type, last])
    return cells + ([f"{mine / plain:.2f}x"] if plain else [])


def measure(table: bool = False, gguf_type: str | None = None, cache_types: list[str] | None = None) -> None:
    """The table: each file with each KV-cache type (f16 alone by default), speeds and llama.cpp's perplexity
    (with that cache type) beside transformers' for the same weights."""
    cache_types = cache_types or ["f16"]
    cache_file = _path("cache", gguf_type, "json")
    cache = json.loads(cache_file.read_text())
    cache["attention-free"] = {"file": str(_path("smollm2-attention-free", gguf_type))}
    runs = _runs(cache, cache_types, gguf_type, table)
    test = windows(AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF), "movie-snippets", "test[:1000]")
    rows = []
    for cache_type in cache_types:
        for name in list(cache)[:-1]:  # the attention-free file only sets the ceilings
            path = Path(cache[name]["file"])
            kv = runs[name, cache_type, max(CONTEXTS)][0]["kv"] / 2**20
            row = [
                name,
                cache_type,
                f"{path.stat().st_size / 2**20:.1f}",
                f"{kv:.1f}",
                *_speeds(cache, runs, name, cache_type),
            ]
            found = cache[name].setdefault("llama.cpp by cache type", {})
            found[cache_type] = found.get(cache_type) or llama_perplexity(path, test.batches, THREADS, cache_type)
            cache_file.write_text(json.dumps({k: v for k, v in cache.items() if k != "attention-free"}, indent=1))
            theirs = cache[name]["transformers"]
            row.append(f"{found[cache_type]:.2f} / {theirs:.2f} ({100 * (found[cache_type] / theirs - 1):+.1f}%)")
            rows.append(row)
            print(row, flush=True)
    head = (
        ["model", "KV cache type", "file MiB", f"KV cache MiB at {max(CONTEXTS):,}"]
        + [f"{kind} tok/s at {c:,}" for kind in ("prompt", "decode") for c in CONTEXTS]
        + ([f"decode at {max(CONTEXTS):,} against unpruned f16"] if "f16" in cache_types else [])
        + ["perplexity llama.cpp / transformers"]
    )
    print(
        f"\nSmolLM2-135M ({gguf_type or 'Q4_1'} GGUF) in llama.cpp {llama_cpp.__version__} (llama-cpp-python), CPU, "
        f"{THREADS} threads, flash attention; median of {REPEATS} runs in turns; cells: tokens/s (speed-up of "
        f"{{measured}} of {{ceiling}} against the unpruned file with the same KV cache type); perplexity on "
        "movie-snippets test[:1000] windows:\n"
    )
    print(markdown_table(head, rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", action="store_true", help="prune and write the GGUF files first")
    parser.add_argument("--table", action="store_true", help="print the table from the saved runs")
    parser.add_argument("--reference", action="store_true", help="write only the attention-free file")
    parser.add_argument("--gguf-type", choices=ph.export.gguf.FILE_TYPES, help="the whole files in this type")
    parser.add_argument("--ratio", action="append", choices=[r.split()[0] for r in RATIOS], help="only these depths")
    parser.add_argument(
        "--cache-types", default="f16", help=f"KV cache types, comma-separated: {', '.join(CACHE_TYPES)}"
    )
    args = parser.parse_args()
    if args.build:
        build(args.gguf_type, args.ratio)
    elif args.reference:
        reference(args.gguf_type)
    else:
        measure(args.table, args.gguf_type, args.cache_types.split(","))


if __name__ == "__main__":
    main()
