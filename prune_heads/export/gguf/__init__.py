"""GGUF out: a pruned decoder as one GGUF file for llama.cpp and what is built on it (llama-cpp-python,
ollama, LM Studio).

GGUF in, GGUF out (`source`, found by itself for a model loaded with `gguf_file=`): every tensor of the source
file is copied byte for byte in its own quantization when the model still holds exactly its values; q, k and v
keep their quantization with the removed heads' rows dropped (a head is whole rows, and rows are whole blocks
in every GGML type); the source's metadata (tokenizer, chat template, rope settings) is kept. What changed is
not assumed but checked: each tensor is dequantized and compared with the model's own weights, and whatever
differs (output projections with folded scales, new output biases) is written in `tensor_type`.

Hugging Face in (no source): every tensor in `tensor_type` (f16 by default), the metadata llama.cpp needs
from the config (`GgufArch.from_config`), and the tokenizer's vocabulary so llama.cpp tokenizes text to the
same ids: a byte-level BPE tokenizer as llama.cpp's `gpt2` with the pre-tokenizer whose splitting rules are
its own, a sentencepiece-style one (BPE with byte fallback) as llama.cpp's `llama`, with per-token scores
that make llama.cpp merge in the order of the tokenizer's merges.

Llama, Mistral and Qwen2 (Llama with q/k/v biases) are written as llama.cpp's `llama` when every layer keeps
the same heads, else as its `deci` (per-layer head counts; a layer left without heads is attention-free),
so every plan of theirs is held. Qwen3 and Gemma 3 keep their own architectures (only those compute their
per-head q/k norms), which build every layer with the first layer's head counts and load no attention output
bias: even plans without biases (`ARCHITECTURES` says what each family takes). Read from llama.cpp's loaders:
qwen2 wants q of n_embd x n_embd, and phi3 q and the output projection of n_embd x n_embd, which no pruned
model has.
"""

from ...config import FILE_TYPES, GGUF_TYPES
from .architectures import ARCHITECTURES, GgufArch, GgufError
from .inspect import gguf_heads, quantized
from .speed import LlamaCheck, LlamaSpeed, llama_checks, llama_cpp_installed, llama_perplexity, llama_speed
from .tokenizer import tokenizer_model
from .writer import check_gguf, save_gguf

__all__ = [
    "ARCHITECTURES",
    "FILE_TYPES",
    "GGUF_TYPES",
    "GgufArch",
    "GgufError",
    "check_gguf",
    "gguf_heads",
    "LlamaCheck",
    "LlamaSpeed",
    "llama_checks",
    "llama_cpp_installed",
    "llama_perplexity",
    "llama_speed",
    "quantized",
    "save_gguf",
    "tokenizer_model",
]
