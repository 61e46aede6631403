"""Saving and loading pruned models.

A pruned checkpoint is a normal transformers checkpoint whose config also records, per attention layer,
the original head counts and the removed heads (`config.prune_heads`). Loading builds the model from its
config, re-applies the surgery, and only then loads the weights, through `from_pretrained` itself.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..errors import PruneHeadsError
from ..model.layers import UnsupportedModelError, find_attention, resolve
from ..model.surgery import RECORD_KEY, RecordError, reapply_record
from ..runtime.progress import library_bars
from .standalone import standalone_config, write_code

logger = logging.getLogger("prune_heads")


GGUF_SOURCE = "gguf_source"  # the model attribute naming the local GGUF file it was loaded from (not its config)
GGUF_SOURCE_FILE = "gguf_source.txt"  # that file's path, saved beside the weights so a reloaded model keeps it
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelNotFoundError(PruneHeadsError, FileNotFoundError):
    """Raised for a model reference that is neither an existing folder nor a hub id."""


class OutputExistsError(PruneHeadsError, FileExistsError):
    """Raised when a save would overwrite an existing folder without `overwrite=True`."""


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a local folder's safetensors files, read from their headers ({} for a hub
    id or a checkpoint in another format)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        with safe_open(file, framework="pt") as tensors:
            shapes.update({key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()})  # noqa: SIM118 (safetensors' handle is not a dict)
    return shapes


def _check_shapes(model: nn.Module, shapes: dict[str, tuple[int, ...]], record: dict) -> None:
    for name, tensor in model.state_dict().items():
        layer = next((layer for layer in record["layers"] if name.startswith(layer + ".")), None)
        saved = shapes.get(name)
        if layer is not None and saved is not None and saved != tuple(tensor.shape):
            raise RecordError(
                f"config.{RECORD_KEY} layer {layer!r} does not match the saved weights: {name} is "
                f"{list(saved)} in the checkpoint, {list(tensor.shape)} for the recorded heads; "
                f"restore the config.json that save_pruned wrote"
            )


def _pruned_subclass(base: type, shapes: dict[str, tuple[int, ...]]) -> Any:
    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        record = getattr(config, RECORD_KEY, None)
        reapply_record(self, record)
        if record:
            _check_shapes(self, shapes, record)

    return type(
        base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__, "__qualname__": base.__qualname__}
    )


def model_class(config: Any, gguf: bool = False) -> Any:
    """The transformers class named by `config.architectures[0]`; for a GGUF file, whose config names none,
    the causal language model of the config's type."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures and gguf and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not architectures or not hasattr(transformers, architectures[0]):
        raise UnsupportedModelError(
            f"unknown architecture {architectures!r} in the model's config.json: name a "
            f"transformers model class there (as save_pretrained records it)"
        )
    return getattr(transformers, architectures[0])


def load_pruned(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved by `save_pruned` (or `model.save_pretrained` after `prune`).

    Works for unpruned checkpoints too, and for a GGUF file in the folder (`gguf_file=`; transformers
    dequantizes it, and the file's path is kept in `model.gguf_source`, not the config, for `save_gguf`; a
    folder `save_pruned` wrote from such a model keeps it in gguf_source.txt). Keyword arguments
    go to `from_pretrained` (dtype, device_map, revision, gguf_file, ...).
    The model comes back as an instance of its ordinary transformers class.
    """
    if not Path(path).expanduser().exists() and not HUB_ID.match(str(path)):
        raise ModelNotFoundError(f"no folder {path}, and not a hub id (those look like 'org/name'); check the path")
    with gguf_read_once() if "gguf_file" in from_pretrained_kwargs else contextlib.nullcontext():
        model = _load(path, from_pretrained_kwargs)
    folder = Path(path).expanduser()
    gguf_file = folder / from_pretrained_kwargs.get("gguf_file", "")
    if "gguf_file" in from_pretrained_kwargs and gguf_file.is_file():  # what save_gguf copies tensors from
        setattr(model, GGUF_SOURCE, str(gguf_file.resolve()))
    elif (folder / GGUF_SOURCE_FILE).is_file():  # saved from a model read from a GGUF file
        setattr(model, GGUF_SOURCE, (folder / GGUF_SOURCE_FILE).read_text().strip())
    elif hasattr(model.config, GGUF_SOURCE):  # saved before the path left the config: moved out of it
        setattr(model, GGUF_SOURCE, getattr(model.config, GGUF_SOURCE))
        delattr(model.config, GGUF_SOURCE)
    return model


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within it, each GGUF file is parsed once and gguf's tensor-name table built once per architecture:
    transformers parses the file again for the config, the tokenizer and the weights, and builds the table
    again for every tensor, most of the time a GGUF model takes to load. gguf is left as it was after."""
    try:
        import gguf
    except ImportError:  # transformers says what is missing
        yield
        return
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names  # type: ignore[misc]


def _load(path: str | os.PathLike, from_pretrained_kwargs: dict[str, Any]) -> nn.Module:
    """The checkpoint as its ordinary transformers class, its pruned shapes read from the weights."""
    config = AutoConfig.from_pretrained(
        path,
        **{
            k: v
            for k, v in from_pretrained_kwargs.items()
            if k in ("revision", "token", "trust_remote_code", "gguf_file")
        },
    )
    base = model_class(config, gguf="gguf_file" in from_pretrained_kwargs)
    with library_bars():
        model = _pruned_subclass(base, checkpoint_shapes(path)).from_pretrained(path, **from_pretrained_kwargs)
    model.__class__ = base
    return model


def ensure_free(target: Path, overwrite: bool) -> None:
    """Raise OutputExistsError unless `target` can be written: absent or an empty folder (or any folder with
    `overwrite`), not a file, and inside a folder this user may write to."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputExistsError(f"{target} is a file; give a folder path for the model")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"{target} already exists and is not empty; choose another folder or pass overwrite=True (--force)"
        )
    parent = next(p for p in [target, *target.resolve().parents] if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputExistsError(f"cannot write to {parent}: choose a folder you can write to")


_RENAME_EXCHANGE = 2  # renameat2 flag (Linux): swap two paths in one atomic step


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically where the system can (Linux renameat2); False where it cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EBUSY, errno.EXDEV):  # unsupported here, or a mount point
        return False
    raise OSError(code, os.strerror(code), str(b))


def _link_unnamed(fd: int, path: Path) -> None:
    """Give the unnamed (O_TMPFILE) file open as `fd` the name `path` (linkat through /proc, following it)."""
    at_cwd, follow = -100, 0x400  # AT_FDCWD, AT_SYMLINK_FOLLOW
    linkat = ctypes.CDLL(None, use_errno=True).linkat
    if linkat(at_cwd, os.fsencode(f"/proc/self/fd/{fd}"), at_cwd, os.fsencode(path), follow) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temporary(target: Path, kind: str = "") -> str:
    """The prefix of this process's hidden temporary folders for `target`: `.NAME.[old.]PID.`."""
    return f".{target.name}.{kind}{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(target: Path) -> list[Path]:
    """Remove the hidden temporary folders and files that a killed save to `target` left beside it (or inside
    it, for a mount point): those of processes no longer running. A save still under way keeps its own.
    Returns them."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:old\.)?(\d+)\.[^/]+")
    places = [target.parent] + ([target] if target.is_dir() and os.path.ismount(target) else [])
    stale = [
        entry
        for place in places
        if place.is_dir()
        for entry in place.iterdir()
        if (found := pattern.fullmatch(entry.name)) and not _alive(int(found.group(1)))
    ]
    for entry in stale:
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    return stale


def ensure_file_free(target: Path, overwrite: bool) -> None:
    """Raise OutputExistsError unless a file can be written at `target`: absent (or a file, with
    `overwrite`), not a folder, in a folder this user may write to."""
    target = Path(target)
    if target.is_dir():
        raise OutputExistsError(f"{target} is a folder; give a file path (for example {target / 'model.gguf'})")
    if target.exists() and not overwrite:
        raise OutputExistsError(f"{target} already exists; choose another file or pass overwrite=True (--force)")
    parent = next(p for p in target.resolve().parents if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputExistsError(f"cannot write to {parent}: choose a folder you can write to")


def replace_file(target: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Call `write(path)` to write one file and put it at `target` in one step, so that an interrupted write
    leaves the old file or none, never a partial one.

    On Linux the file is written unnamed (O_TMPFILE) and linked into place when complete: a killed write
    leaves nothing behind. Elsewhere it is written under a hidden temporary name and renamed; the temporary
    files of killed writes are removed by the next write to `target` (`remove_stale`). Raises
    OutputExistsError as `ensure_file_free` does.
    """
    target = Path(target)
    ensure_file_free(target, overwrite)
    remove_stale(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{_temporary(target)}{os.urandom(4).hex()}"
    unnamed = getattr(os, "O_TMPFILE", None)
    try:
        fd = (
            os.open(target.parent, unnamed | os.O_WRONLY, 0o666) if unnamed and Path("/proc/self/fd").is_dir() else None
        )
    except OSError:  # a file system without unnamed files
        fd = None
    try:
        if fd is not None:
            write(Path(f"/proc/self/fd/{fd}"))
            _link_unnamed(fd, tmp)
        else:
            write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return target


def replace_folder(target: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` and put the result at `target` so that an interrupted save leaves the old folder
    or the new one, never a mix.

    The new folder is written beside `target` under a hidden temporary name (mode from the umask, as
    save_pretrained makes it) and swapped in with one atomic exchange (Linux) or two renames. A mount point
    cannot be renamed: its entries are replaced one by one instead. The temporary folders a killed save left
    for `target` are removed first (`remove_stale`). Raises OutputExistsError when `target` is not empty and
    `overwrite` is False (see ensure_free).
    """
    target = Path(target)
    ensure_free(target, overwrite)
    remove_stale(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    mount = target.is_dir() and os.path.ismount(target)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary(target), dir=target if mount else target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        write(tmp)
        if mount:
            for entry in target.iterdir():
                if entry != tmp:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            for entry in tmp.iterdir():
                os.replace(entry, target / entry.name)
            tmp.rmdir()
        elif not target.exists():
            os.replace(tmp, target)
        elif _exchange(tmp, target):
            shutil.rmtree(tmp)  # now holds the old folder
        else:
            old = Path(tempfile.mkdtemp(prefix=_temporary(target, "old."), dir=target.parent))
            os.replace(target, old / "replaced")
            os.replace(tmp, target)
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


_STOCK_FAMILIES = ("llama",)  # families whose config can state per-model head counts natively


def stock_config(model: nn.Module) -> Any | None:
    """A plain config for a pruned model whose every layer kept the same heads and KV heads, for families
    whose config says so natively (Llama, Mistral, Qwen2/3, Gemma...): num_attention_heads,
    num_key_value_heads and head_dim set (and `attention_bias` when pruning added output biases and the
    class reads it), the prune record moved to `pruned_from`. None otherwise, and None unless the class
    built from it has exactly the model's weights (missing ones may only be biases, saved as zeros)."""
    config = getattr(model, "config", None)
    record = getattr(config, RECORD_KEY, None)
    if not record:  # nothing removed (a model with no layer prune_heads handles saves as it is)
        return None
    layers = find_attention(model)
    if not layers or any(l.spec.name not in _STOCK_FAMILIES for l in layers):
        return None
    shapes = {(l.num_heads, l.num_kv_heads, l.head_dim) for l in layers}
    if len(shapes) != 1 or next(iter(shapes))[0] == 0:
        return None
    heads, kv_heads, head_dim = shapes.pop()
    stock: Any = copy.deepcopy(config)
    stock.num_attention_heads, stock.num_key_value_heads, stock.head_dim = heads, kv_heads, head_dim
    delattr(stock, RECORD_KEY)
    stock.pruned_from = record
    if stock_fill(model, stock) is None and hasattr(stock, "attention_bias") and not stock.attention_bias:
        stock.attention_bias = True  # pruning added output biases: q/k/v get zero ones
    return stock if stock_fill(model, stock) is not None else None


def output_biases_load(model: nn.Module) -> bool:
    """Whether a stock config of the model (see `stock_config`) can hold a bias on every attention layer's
    output projection, as recovery adds: the class built from its config with `attention_bias` set (where the
    config has it) has those biases (Llama, Qwen3, Gemma; not Qwen2, Mistral)."""
    config: Any = copy.deepcopy(getattr(model, "config", None))
    if config is None:
        return False
    if hasattr(config, "attention_bias"):
        config.attention_bias = True
    with torch.device("meta"):
        shell = type(model)(config)
    return all(resolve(l.module, l.spec.o).bias is not None for l in find_attention(shell))


def stock_fill(model: nn.Module, config: Any) -> dict[str, torch.Tensor] | None:
    """The zero biases to save beside the model's weights so that its class, built from `config`, loads them
    exactly; None when that class's weights differ from the model's in any other way."""
    with torch.device("meta"):
        shell = type(model)(config)
    expected = {k: v.shape for k, v in shell.state_dict().items()}
    own = model.state_dict()
    if any(k not in expected or expected[k] != v.shape for k, v in own.items()):
        return None
    missing = {k: shape for k, shape in expected.items() if k not in own}
    if not all(k.endswith(".bias") for k in missing):
        return None
    reference = next(iter(own.values()))
    return {k: torch.zeros(shape, dtype=reference.dtype) for k, shape in missing.items()}


def save_pruned(
    model: nn.Module, path: str | os.PathLike, tokenizer: Any = None, overwrite: bool = False, standalone: bool = False
) -> Path:
    """Save a (pruned) model, and its tokenizer or processor if given, so `load_pruned` restores it exactly.

    When every layer kept the same heads and the family's config can say so (Llama-style), the saved config
    is a stock one (see `stock_config`): plain `AutoModelForCausalLM.from_pretrained` and other runtimes load
    it with no code of ours. Otherwise `standalone=True` writes a small modeling file and an `auto_map` into
    the checkpoint, so `AutoModel*.from_pretrained(path, trust_remote_code=True)` loads it where prune_heads
    is not installed (see `prune_heads.standalone`). The folder is written under a temporary name and
    renamed into place, so an interrupted save leaves no half-written model. Raises OutputExistsError if
    `path` exists and `overwrite` is False.
    """
    return replace_folder(Path(path), overwrite, lambda tmp: write_model(model, tmp, tokenizer, standalone))


def drop_gguf_quantizer(model: nn.Module) -> bool:
    """Forget that `model` was loaded from a GGUF file (transformers already dequantized its weights, but
    marks it quantized and refuses to save it): drop the quantizer and `quantization_config`, say so once.
    Returns whether there was one. Other quantizers are left alone."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        return False
    quantizer.remove_quantization_config(model)
    logger.warning(
        "the model was loaded from a GGUF file: it is saved dequantized, as %s safetensors "
        "(its GGUF quantizer is dropped)",
        str(next(model.parameters()).dtype).replace("torch.", ""),
    )
    return True


def head_bound(model: nn.Module) -> bool:
    """Whether transformers' conversion back to the checkpoint's original layout reads the config's head count
    (the RoPE row permutations of fused or interleaved checkpoints): it cannot hold for layers that lost heads,
    so such a pruned model is saved in transformers' own layout, which transformers loads as it is."""
    try:
        from transformers import core_model_loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers 5 without weight conversions
        return False
    kinds = tuple(
        getattr(core_model_loading, name)
        for name in ("PermuteForRope", "VisionFuseAndPermuteForRope", "VisionUnfuseAndPermuteForRope")
        if hasattr(core_model_loading, name)
    )
    pretrained: Any = model  # a transformers model (its conversions are looked up)
    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(
        pretrained, add_legacy=False
    )
    return any(
        isinstance(op, kinds) for conversion in conversions or [] for op in getattr(conversion, "operations", [])
    )


def write_model(model: nn.Module, folder: Path, tokenizer: Any = None, standalone: bool = False) -> None:
    """Write the model (with a stock config when `stock_config` gives one, else with remote code when
    `standalone`) and its tokenizer into an existing folder; `save_pruned` and the pipeline write through here.
    A model loaded from GGUF is written dequantized (see `drop_gguf_quantizer`)."""
    drop_gguf_quantizer(model)
    config = stock_config(model)
    standalone_code = config is None and standalone and getattr(model.config, RECORD_KEY, None)
    if standalone_code:
        config = standalone_config(model)
        write_code(model, folder)
    original = model.config
    fill = stock_fill(model, config) if config is not None and not standalone_code else None
    if config is not None:
        model.config = config
    layout = {"save_original_format": False} if getattr(model.config, RECORD_KEY, None) and head_bound(model) else {}
    pretrained: Any = model
    try:
        with library_bars():
            pretrained.save_pretrained(folder, state_dict={**model.state_dict(), **fill} if fill else None, **layout)
    finally:
        model.config = original
    if getattr(model, GGUF_SOURCE, None):
        (folder / GGUF_SOURCE_FILE).write_text(getattr(model, GGUF_SOURCE) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
