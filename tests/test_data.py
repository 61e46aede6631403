import json

import pytest
import torch
from transformers import AutoTokenizer

from prune_heads.runtime.progress import library_bars
from prune_heads.task_data import DataError, TaskData, load_split, load_task_data, with_targets


@pytest.fixture(scope="module")
def tokenizer(fixture_model_path):
    return AutoTokenizer.from_pretrained(fixture_model_path)


def test_folder_of_split_files_with_slicing(fixture_data_path, tokenizer):
    data = load_task_data(str(fixture_data_path), tokenizer, split="test[:50]", batch_size=16, max_length=32)
    assert data.num_examples == 50 and len(data) == 4 and data.task == "classification"
    first = data.batches[0]
    assert set(first) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert first["input_ids"].shape[0] == 16 and first["input_ids"].shape[1] <= 32
    expected = [json.loads(l)["label"] for l in (fixture_data_path / "test.jsonl").read_text().splitlines()[:50]]
    assert sorted(torch.cat([b["labels"] for b in data]).tolist()) == sorted(expected)
    lengths = [int(n) for b in data for n in b["attention_mask"].sum(-1)]
    assert lengths == sorted(lengths)  # batched by length: little padding
    in_order = load_task_data(
        str(fixture_data_path), tokenizer, split="test[:50]", batch_size=16, max_length=32, by_length=False
    )
    assert torch.cat([b["labels"] for b in in_order]).tolist() == expected
    assert data.without_labels()[0].keys() == {"input_ids", "token_type_ids", "attention_mask"}


def test_batches_are_padded_to_their_own_longest(fixture_data_path, tokenizer):
    data = load_task_data(str(fixture_data_path / "validation.jsonl"), tokenizer, split="validation[:40]", batch_size=8)
    longest = [int(b["attention_mask"].sum(-1).max()) for b in data]
    assert [b["input_ids"].shape[1] for b in data] == longest  # each batch as wide as its longest example
    assert len(set(longest)) > 1  # dynamic padding, not one global width
    for batch in data:  # the padding is the tokenizer's pad id, after each example's own tokens
        lengths = batch["attention_mask"].sum(-1)
        for ids, mask, n in zip(batch["input_ids"], batch["attention_mask"], lengths):
            assert mask[:n].all() and not mask[n:].any()
            assert (ids[n:] == tokenizer.pad_token_id).all() and (ids[:n] != tokenizer.pad_token_id).all()


def test_csv_with_string_labels_and_pairs(tmp_path, tokenizer):
    (tmp_path / "pairs.csv").write_text(
        "premise,hypothesis,label\na cat,an animal,entailment\na dog,a car,contradiction\n"
    )
    data = load_task_data(
        str(tmp_path / "pairs.csv"),
        tokenizer,
        split="train",
        text_column="premise",
        text_pair_column="hypothesis",
        label2id={"contradiction": 0, "entailment": 1},
    )
    assert data.batches[0]["labels"].tolist() == [1, 0]
    assert data.label_names == ["contradiction", "entailment"]
    assert (data.batches[0]["token_type_ids"] == 1).any()  # the pair is encoded as a pair


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"text_column": "text"}, "no text column 'text'; the data has columns idx, sentence, label"),
        ({"label_column": "stars"}, "no label column 'stars'"),
        ({"split": "dev"}, "no split 'dev' in .*; it has test, train, validation"),
        ({"task": "summarize"}, "unknown task 'summarize'"),
    ],
)
def test_missing_columns_and_splits_list_what_exists(fixture_data_path, tokenizer, kwargs, message):
    with pytest.raises(DataError, match=message):
        load_task_data(str(fixture_data_path), tokenizer, **kwargs)


def test_unknown_split_of_a_file_and_unknown_file_type(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"sentence": "x", "label": 0}\n')
    with pytest.raises(DataError, match="split 'train\\[:abc\\]'"):
        load_split(str(tmp_path / "a.jsonl"), "train[:abc]")
    (tmp_path / "a.xml").write_text("<a/>")
    with pytest.raises(DataError, match="unknown file type '.xml'"):
        load_split(str(tmp_path / "a.xml"), "train")


def test_language_model_windows_score_each_token_once(tmp_path, tokenizer):
    (tmp_path / "corpus.txt").write_text("\n".join(f"line number {i} of the corpus." for i in range(60)))
    data = load_task_data(
        str(tmp_path / "corpus.txt"),
        tokenizer,
        task="causal-lm",
        split="train",
        text_column="text",
        max_length=32,
        stride=16,
        batch_size=4,
    )
    tokens = data.info["tokens"]
    windows = torch.cat([b["input_ids"][:, 0] for b in data])  # one row per window
    labelled = sum(int((b["labels"][:, 1:] != -100).sum()) for b in data)
    assert labelled == tokens - 1  # every token after the first is predicted exactly once
    assert len(windows) == data.num_examples > 1


@pytest.mark.parametrize("stride", [None, 8])
def test_language_model_windows_start_with_the_bos_the_tokenizer_adds(tmp_path, stride):
    """A tokenizer that starts every text with <bos> (Gemma's) gets it at the start of every window, unscored;
    every text token is then predicted exactly once, the first one included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {"<bos>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(100)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    bos_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="[UNK]")
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(f"w{(i + j) % 100}" for j in range(7)) for i in range(30)))
    data = load_task_data(
        str(tmp_path / "corpus.txt"),
        bos_tokenizer,
        task="causal-lm",
        split="train",
        text_column="text",
        max_length=16,
        stride=stride,
        batch_size=4,
    )
    ids = torch.cat([b["input_ids"] for b in data])
    labels = torch.cat([b["labels"] for b in data])
    text = torch.cat([b["attention_mask"] for b in data])[:, 1:] == 1
    assert (ids[:, 0] == 0).all() and (labels[:, 0] == -100).all() and (ids[:, 1:][text] != 0).all()
    assert int((labels[:, 1:] != -100).sum()) == data.info["tokens"] == 30 * 7
    assert data.num_examples == (14 if stride is None else 26)
    with pytest.raises(DataError, match="--max-length 2 or more"):
        load_task_data(
            str(tmp_path / "corpus.txt"), bos_tokenizer, "causal-lm", "train", text_column="text", max_length=1
        )


def test_no_library_bars_when_stderr_is_not_a_terminal(tmp_path, monkeypatch, capfd):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # a fresh cache: the split is generated
    (tmp_path / "validation.jsonl").write_text('{"sentence": "a", "label": 0}\n')
    assert len(load_split(str(tmp_path))) == 1
    assert capfd.readouterr().err == ""  # datasets printed "Generating validation split" bars here
    assert datasets.is_progress_bar_enabled()  # switched back on afterwards


def test_library_bars_silences_plain_tqdm_and_restores_it(capfd):
    """Libraries that call tqdm themselves (transformers' GGUF dequantization, lm-eval) print nothing inside;
    tqdm read TQDM_DISABLE when it was imported, so only the scoped constructor can stop them."""
    from tqdm.auto import tqdm

    with library_bars():
        list(tqdm(range(3), desc="a library's own bar"))
    assert "a library's own bar" not in capfd.readouterr().err
    list(tqdm(range(3), desc="outside"))
    assert "outside" in capfd.readouterr().err


def test_with_targets_gives_each_batch_its_examples_labels_and_leaves_other_data_alone():
    batches = [{"input_ids": torch.zeros(n, 4, dtype=torch.long)} for n in (3, 2, 4)]
    data = TaskData("feature-extraction", batches, 9, ["a", "b"], targets=[0, 1, 1, 0, 0, 1, 1, 1, 0])
    labelled = with_targets(data)
    assert [b["labels"].tolist() for b in labelled] == [[0, 1, 1], [0, 0], [1, 1, 1, 0]]
    assert all("labels" not in b for b in data.batches)  # the data itself is not changed
    assert with_targets(batches) == batches and with_targets(TaskData("feature-extraction", batches, 9)) == batches
