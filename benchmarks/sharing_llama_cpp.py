"""Shared KV heads in llama.cpp: prompt and decode speed at 2,048 and 8,192 tokens of context against removal at
the same KV-cache size, and llama.cpp's agreement with transformers on the shared weights.

SmolLM2-135M (its Q4_1 GGUF, 9 query heads over 3 KV heads in 30 layers): a third of the KV cache gone (layers
0-14 cut to one KV head) and two thirds (every layer), by removal (KV heads 1 and 2 go with their 6 query
heads) and by sharing (KV heads 1 and 2 merged into 0, their keys mapped from calibration windows, every query
head kept). Speed and agreement only: the weights are not refitted (their quality is benchmarks/sharing.py's).
The Llama-3.2-1B shape (random weights; SmolLM2's tokenizer and vocabulary): 32 query heads over 8 KV heads
shared to 4 and to 2 in every layer, written as GGUF (f16) and run in llama.cpp beside the unpruned file.

Run: .venv/bin/python benchmarks/sharing_llama_cpp.py [--contexts 2048,8192] [--parts smollm2,1b]   (about 25 minutes
     on 2 cores, a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from common import FIXTURES, Timer, markdown_table
from cost_model import config
from in_llama_cpp import OUT, THREADS, LlamaLog, speed
from llama_cpp import Llama
from llm import GGUF, perplexity, smollm2_folder, windows
from transformers import AutoModelForCausalLM, AutoTokenizer

import prune_heads as ph
from prune_heads.export.gguf.speed import llama_perplexity
from prune_heads.model.kv_sharing import fit_key_maps, share_kv_heads
from prune_heads.recovery.sharing_statistics import key_products

REPEATS = 3
SMOLLM2_CUTS = {"a third": range(15), "two thirds": range(30)}  # the layers cut to one KV head
SHARED_1B = {"8 -> 4": 2, "8 -> 2": 4}  # KV heads merged into each kept one


def shared(model, sharing: dict[int, dict[int, int]], batches: list[dict]):
    """`model` with `sharing` in place, each merged head's keys mapped onto its kept head's over `batches`."""
    layers = ph.find_attention(model)
    products = key_products(model, [layers[i] for i in sharing], batches)
    maps = {layers[i].name: fit_key_maps(products[layers[i].name], m, layers[i].kv_heads) for i, m in sharing.items()}
    return share_kv_heads(model, sharing, maps, inputs=batches[0])


def smollm2_files(test) -> dict[str, tuple[Path, float]]:
    """The unpruned GGUF and each cut by removal and by sharing, written from the dequantized model, each with
    transformers' perplexity on `test` (the model in memory, before its changed tensors are quantized again)."""
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]").batches[:4]
    load = lambda: ph.load_pruned(folder, gguf_file=GGUF).eval()  # noqa: E731
    files = {"unpruned": (Path(folder) / GGUF, perplexity(load(), test))}
    for cut, layers in SMOLLM2_CUTS.items():
        removed = ph.prune(load(), {i: list(range(3, 9)) for i in layers})
        written = ph.save_gguf(removed, OUT / f"removal-{len(layers)}.gguf", overwrite=True).path
        files[f"removal, {cut}"] = (written, perplexity(removed, test))
        model = shared(load(), {i: {1: 0, 2: 0} for i in layers}, calibration)
        written = ph.save_gguf(model, OUT / f"sharing-{len(layers)}.gguf", overwrite=True).path
        files[f"sharing, {cut}"] = (written, perplexity(model, test))
    return files


def speeds(files: dict[str, Path], contexts: list[int], log: LlamaLog) -> dict:
    """Each file's prompt and decode tokens/s and KV bytes (from llama.cpp's `log`) at each context, REPEATS
    runs in turns."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
    lines = (FIXTURES / "movie-snippets" / "train.jsonl").read_text().splitlines()[:400]
    ids = tokenizer(" ".join(json.loads(line)["sentence"] for line in lines))["input_ids"]
    runs: dict = {(n, c): [] for n in files for c in contexts}
    for _ in range(REPEATS):
        for context in contexts:
            for name, path in files.items():
                runs[name, context].append(speed(path, context, log, ids))
                print(name, context, runs[name, context][-1], flush=True)
    return runs


def speed_table(files: dict[str, Path], contexts: list[int], log: LlamaLog) -> str:
    """The speeds' medians, each against the unpruned file's and sharing's against removal's at its cut."""
    runs = speeds(files, contexts, log)
    median = {(n, c, k): statistics.median(r[k] for r in runs[n, c]) for n, c in runs for k in ("prompt", "decode")}
    rows = []
    for name in files:
        twin = name.replace("sharing", "removal")
        cells = [f"{runs[name, max(contexts)][0]['kv'] / 2**20:.0f}"]
        for kind in ("prompt", "decode"):
            for c in contexts:
                rate = median[name, c, kind]
                versus = f" ({rate / median[twin, c, kind]:.2f}x removal's)" if twin != name else ""
                cells.append(f"{rate:.0f} ({rate / median['unpruned', c, kind]:.2f}x){versus}")
        rows.append([name, *cells])
    head = ["file", f"KV cache MiB at {max(contexts):,}"]
    head += [f"{kind} tok/s at {c:,}" for kind in ("prompt", "decode") for c in contexts]
    return markdown_table(head, rows)


def agreement_table(files: dict[str, tuple[Path, float]], test) -> str:
    """llama.cpp's perplexity on `test` beside transformers' per file."""
    rows = []
    for name, (path, ours) in files.items():
        theirs = llama_perplexity(path, test.batches, THREADS)
        rows.append([name, f"{theirs:.2f} / {ours:.2f} ({100 * (theirs / ours - 1):+.2f}%)"])
    return markdown_table(["file", "perplexity, llama.cpp / transformers (movie test[:300])"], rows)


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`."""
    llm = Llama(
        model_path=str(path), n_ctx=len(ids), n_batch=len(ids), n_threads=THREADS, logits_all=True, verbose=False
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def one_b_table() -> str:
    """The Llama-3.2-1B shape unpruned and shared to 4 and 2 KV heads per layer: llama.cpp against transformers
    (largest logit difference over the largest logit, top tokens agreeing), file size and the build's time."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
    found = config("llama-3.2-1b", vocab_size=len(tokenizer), tie_word_embeddings=True)
    calibration = windows(tokenizer, "movie-snippets", "train[:100]", batch_size=4).batches[:2]
    ids = calibration[1]["input_ids"][0][:128].tolist()
    rows = []
    for name, merged in {"unpruned": 1, **SHARED_1B}.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(found, dtype=torch.float32).eval()
        with Timer() as timer:
            if merged > 1:
                kv = found.num_key_value_heads
                sharing = {j: j - j % merged for j in range(kv) if j % merged}
                shared(model, dict.fromkeys(range(found.num_hidden_layers), sharing), calibration)
        written = ph.save_gguf(
            model, OUT / f"llama-1b-{name.split()[-1]}.gguf", tokenizer=tokenizer, tensor_type="f16", overwrite=True
        )
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].float().numpy()
        got = llama_logits(written.path, ids)
        heads = ph.find_attention(model)[0]
        rows.append(
            [
                name,
                f"{heads.num_heads} over {len(heads.kv_heads)}",
                written.architecture,
                f"{np.abs(got - expected).max() / np.abs(expected).max():.2e}",
                f"{np.mean(got.argmax(-1) == expected.argmax(-1)):.3f}",
                f"{written.path.stat().st_size / 2**30:.2f}",
                f"{timer.seconds:.0f}",
            ]
        )
        print(rows[-1], flush=True)
        del model
    head = [
        "Llama-3.2-1B shape",
        "heads per layer",
        "GGUF architecture",
        "max logit difference / max logit",
        "top token agrees",
        "file GiB",
        "sharing s",
    ]
    return markdown_table(head, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="2048,8192", help="the contexts of the speed runs, tokens")
    parser.add_argument("--parts", default="smollm2,1b", help="smollm2 (speed, agreement), 1b (the 1B shape)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    log = LlamaLog()  # llama.cpp calls its callback for as long as the process runs
    if "smollm2" in args.parts:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
        test = windows(tokenizer, "movie-snippets", "test[:300]")
        files = smollm2_files(test)
        paths = {name: path for name, (path, _) in files.items()}
        print(f"SmolLM2-135M in llama.cpp, {THREADS} threads, flash attention, median of {REPEATS} runs in turns:\n")
        print(speed_table(paths, [int(c) for c in args.contexts.split(",")], log), "\n")
        print(agreement_table(files, test), "\n")
    if "1b" in args.parts:
        print(one_b_table())


if __name__ == "__main__":
    main()
