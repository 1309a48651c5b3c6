"""The own WordPiece tokenizer: rules on a toy vocabulary, and identical ids to the
``tokenizers`` package (test-only dependency) with the real all-MiniLM-L6-v2 vocabulary."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from bakron.models.wordpiece import WordPieceTokenizer, basic_tokenize

REF = pathlib.Path(__file__).parent / "data" / "minilm_reference"

EDGE_CASES = [
    "Ünïcödé\u0000 \ufffd tab\there\x0bx", "İstanbul ΣΟΦΟΣ", "日本語のテキスト 한국어",
    "a" * 101, "a" * 100, "x\u200by", "«quoted» — “smart” ‘quotes’", "emoji 😀 ok",
    "e\u0301te ﬁ ① ²", "   ", "", "don't stop-believing!!!", "word " * 400,
    "line\nbreak\r\nand\u2028sep\u00a0nbsp", "$100 + 5% = ~x^2 | y` {z}", "中文abc中",
]


@pytest.fixture(scope="module")
def model_dir():
    from bakron.models.minilm import ModelUnavailableError, model_files

    try:
        return model_files()
    except ModelUnavailableError as exc:
        pytest.skip(f"the all-MiniLM-L6-v2 wheel is not cached and cannot be downloaded: {exc}")


def toy(max_length=16, **kw):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "unaff", "a", "##a",
             "b", ",", "!", "hello", "world", "cafe", "数", "据", "abc"]
    return WordPieceTokenizer(vocab, max_length=max_length, **kw)


def test_basic_tokenize_rules():
    assert basic_tokenize("Hello, World!") == ["hello", ",", "world", "!"]
    assert basic_tokenize("Café naïve RÉSUMÉ") == ["cafe", "naive", "resume"]
    assert basic_tokenize("数据abc") == ["数", "据", "abc"]
    # NUL and a zero-width space (format char) vanish, the tab splits
    assert basic_tokenize("a\x00b\u200bc\td") == ["abc", "d"]
    assert basic_tokenize("«hi»...") == ["«", "hi", "»", ".", ".", "."]
    assert basic_tokenize("$5+x") == ["$", "5", "+", "x"]
    assert basic_tokenize("  \n ") == []
    with pytest.raises(TypeError, match="str"):
        basic_tokenize(b"bytes")


def test_wordpiece_greedy_longest_match():
    t = toy()
    ids = t.vocab
    # greedy longest first: "unaff" + "##able", not "un" + "##aff" + "##able"
    assert t.tokenize_ids("unaffable") == [ids["unaff"], ids["##able"]]
    assert t.tokenize_ids("aaa") == [ids["a"], ids["##a"], ids["##a"]]
    # a word that cannot be covered becomes one [UNK]; the others are unaffected
    assert t.tokenize_ids("hello unaffx world") == [ids["hello"], t.unk_id, ids["world"]]
    assert t.encode("Hello, world!") == [t.cls_id, ids["hello"], ids[","], ids["world"],
                                         ids["!"], t.sep_id]


def test_wordpiece_long_word_and_truncation():
    t = toy(max_length=5, max_chars_per_word=4)
    assert t.tokenize_ids("aaaa") == [t.vocab["a"]] + [t.vocab["##a"]] * 3
    assert t.tokenize_ids("aaaaa") == [t.unk_id]           # longer than 4 characters
    enc = t.encode("a b a b a b")
    assert len(enc) == 5 and enc[0] == t.cls_id and enc[-1] == t.sep_id
    assert enc[1:4] == [t.vocab["a"], t.vocab["b"], t.vocab["a"]]


def test_pad_and_errors():
    t = toy()
    ids, mask = t.pad([[2, 5, 3], [2, 3]])
    assert ids.tolist() == [[2, 5, 3], [2, 3, 0]]
    assert mask.tolist() == [[True, True, True], [True, True, False]]
    with pytest.raises(ValueError, match="empty"):
        t.pad([])
    with pytest.raises(ValueError, match="duplicate"):
        WordPieceTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "a"])
    with pytest.raises(ValueError, match=r"\[SEP\]"):
        WordPieceTokenizer(["[PAD]", "[UNK]", "[CLS]"])
    with pytest.raises(ValueError, match="max_length"):
        toy(max_length=1)


def test_vocab_file_and_real_vocabulary(model_dir):
    t = WordPieceTokenizer.from_vocab_text((model_dir / "vocab.txt").read_text("utf-8"))
    assert len(t.vocab) == 30522 and (t.pad_id, t.unk_id, t.cls_id, t.sep_id) == (0, 100, 101, 102)
    assert t.max_length == 256
    assert t.encode("The quick brown fox.")[:1] == [101]
    assert len(t.encode("word " * 400)) == 256


def test_identical_ids_to_tokenizers_package(model_dir):
    tokenizers = pytest.importorskip("tokenizers", reason="test-only dependency: "
                                                          "pip install tokenizers")
    ref = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref.no_padding()
    ref.enable_truncation(256)
    ours = WordPieceTokenizer.from_vocab_text((model_dir / "vocab.txt").read_text("utf-8"),
                                              max_length=256)
    texts = json.loads((REF / "texts.json").read_text("utf-8"))
    assert len(texts) == 256
    bad = [t for t in texts + EDGE_CASES if ref.encode(t).ids != ours.encode(t)]
    assert bad == [], f"{len(bad)} texts tokenised differently, first: {bad[0]!r}"
    # and the reference set really exercises the rules: unknown words, accents, CJK, ##
    all_ids = np.concatenate([ours.encode(t) for t in texts])
    assert (all_ids == ours.unk_id).any()
    assert any(tok.startswith("##") for tok, i in ours.vocab.items() if i in set(all_ids))
