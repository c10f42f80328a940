"""Tests for the text corpus loader, the character tokenizer and the shifted-window dataset."""

import pytest
import torch

from ddpkit.data.text import CharDataset, CharTokenizer, load_text
from ddpkit.errors import ConfigError


def test_default_corpus_is_pydoc_topics_in_sorted_key_order():
    from pydoc_data.topics import topics

    text = load_text(None)
    first, second = sorted(topics)[:2]
    assert text.startswith(topics[first] + "\n" + topics[second])
    assert len(text) == sum(map(len, topics.values())) + len(topics) - 1


def test_load_text_reads_utf8_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld", encoding="utf-8")
    assert load_text(str(path)) == "héllo wörld"


def test_load_text_missing_file_names_path_and_flag(tmp_path):
    missing = str(tmp_path / "nope.txt")
    # ConfigError (a ValueError) is what the CLI prints as one line with exit code 2.
    with pytest.raises(ConfigError, match="nope.txt") as info:
        load_text(missing)
    assert "--data" in str(info.value)


def test_load_text_rejects_non_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="not valid UTF-8") as info:
        load_text(str(path))
    assert "latin1.txt" in str(info.value) and "--data" in str(info.value)


def test_load_text_rejects_text_shorter_than_a_block(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abcd", encoding="utf-8")
    with pytest.raises(ValueError, match="block_size 4"):
        load_text(str(path), block_size=4)
    assert load_text(str(path), block_size=3) == "abcd"


def test_tokenizer_vocab_is_sorted_distinct_chars():
    tok = CharTokenizer("banana")
    assert tok.vocab_size == 3
    assert tok.encode("abn").tolist() == [0, 1, 2]


def test_tokenizer_round_trip_on_default_corpus():
    text = load_text(None)
    tok = CharTokenizer(text)
    ids = tok.encode(text[:5000])
    assert ids.dtype == torch.long and ids.shape == (5000,)
    assert tok.decode(ids) == text[:5000]
    assert tok.decode(ids[:50].tolist()) == text[:50]


def test_tokenizer_rejects_unknown_character():
    with pytest.raises(ValueError, match="'z'"):
        CharTokenizer("abc").encode("abz")


def test_char_dataset_targets_are_inputs_shifted_by_one():
    data = torch.arange(10)
    ds = CharDataset(data, block_size=4)
    assert len(ds) == 6
    x, y = ds[2]
    assert x.tolist() == [2, 3, 4, 5]
    assert y.tolist() == [3, 4, 5, 6]
    x, y = ds[len(ds) - 1]
    assert y.tolist() == [6, 7, 8, 9]


def test_char_dataset_rejects_out_of_range_index():
    with pytest.raises(IndexError):
        CharDataset(torch.arange(10), block_size=4)[6]


def test_char_dataset_rejects_data_not_longer_than_block():
    with pytest.raises(ValueError, match="block_size 5"):
        CharDataset(torch.arange(5), block_size=5)


def test_load_text_rejects_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        load_text(str(tmp_path))
