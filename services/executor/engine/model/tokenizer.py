"""Text <-> token ids for the engine, and chat-template rendering.

The engine serves GGUF checkpoints, which carry no tokenizer.json, so the byte-level BPE is rebuilt
here from llama.cpp's metadata; Hugging Face directories load their tokenizer.json directly. Either
way the result must tokenize exactly like the reference tokenizer, or the model sees ids it was not
trained on. Chat templates are rendered the way transformers renders them for the same reason.
Streaming output needs its own detokenizer: decoding token by token splits multi-byte characters
and decoding the whole sequence per token is quadratic.
"""

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from shared.core.errors import ModelLoadError, UnsupportedModelError
from shared.errors import InvalidRequestError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> how to split text before BPE. An unknown name is refused rather
# than guessed: a wrong split silently produces ids the model never saw.
_GPT2_PRE = {"gpt-2", "gpt2", "default"}
_DIGITS_PRE = {"smollm", "starcoder", "refact"}  # llama.cpp splits every digit off first for these
_REGEX_PRE = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token_type values


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable spelling of every byte; byte-level vocabularies are written in it.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}` blocks (used by transformers for assistant masks) and renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise InvalidRequestError(str(message), param="messages")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and would change what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"unreadable JSON: {exc}") from exc


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts a server needs."""

    def __init__(self, backend: _Backend, *, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, prepend_bos: bool = False, append_eos: bool = False):
        self.backend = backend
        self._vocab_size = vocab_size
        self._bos, self._eos = bos_token_id, eos_token_id
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        # Only set when the backend's own post-processor does not already add them.
        self._prepend_bos, self._append_eos = prepend_bos, append_eos
        self._special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def load(cls, model_path: str) -> "Tokenizer":
        if os.path.isdir(model_path):
            return cls.from_hf_dir(model_path)
        if model_path.endswith(".gguf"):
            return cls.from_gguf(model_path)
        problem = "expected a .gguf file or a model directory" if os.path.exists(model_path) else "not found"
        raise ModelLoadError(model_path, problem)

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        from services.executor.engine.model.gguf_file import read_gguf  # imports gguf: only GGUF needs it

        if not os.path.isfile(path):
            raise ModelLoadError(path, "file not found")
        try:
            meta = read_gguf(path).metadata.get
        except Exception as exc:  # assorted types on a corrupt header
            raise ModelLoadError(path, f"not a readable GGUF file: {exc}") from exc

        kind = meta("tokenizer.ggml.model")
        tokens = meta("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise ModelLoadError(path, "GGUF metadata has no tokenizer.ggml.model / tokenizer.ggml.tokens")
        if kind != "gpt2":
            raise UnsupportedModelError(path, f"tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        pre = meta("tokenizer.ggml.pre", "default")
        if pre in _DIGITS_PRE:
            pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre in _GPT2_PRE:
            pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre in _REGEX_PRE:
            pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            raise UnsupportedModelError(path, f"tokenizer pre-tokenizer {pre!r} is not supported")

        types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = meta("tokenizer.ggml.merges")
        if merges is None:
            raise ModelLoadError(path, "byte-level BPE GGUF has no tokenizer.ggml.merges")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, tok in enumerate(tokens):
            # Some converters store tokens as raw text; BPE needs them in the byte alphabet the merges use.
            spelled = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(spelled, i)
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
        backend = _Backend(bpe)
        backend.pre_tokenizer = pre_tok
        backend.decoder = decoders.ByteLevel()
        # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; adding them would
        # grow the vocabulary past the embedding table. User-defined tokens (like <think>) must match
        # whole but stay visible in decoded text, as in llama.cpp and transformers.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

        bos, eos = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta("tokenizer.ggml.add_eos_token", False)) and eos is not None
        single, specials = ["$A"], []
        if add_bos:
            single.insert(0, tokens[bos])
            specials.append((tokens[bos], bos))
        if add_eos:
            single.append(tokens[eos])
            specials.append((tokens[eos], eos))
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        return cls(backend, vocab_size=max(len(tokens), backend.get_vocab_size(True)), bos_token_id=bos,
                   eos_token_id=eos, chat_template=meta("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(tok_file, "file not found")
        try:
            backend = _Backend.from_file(tok_file)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON or schema
            raise ModelLoadError(tok_file, f"malformed tokenizer.json: {exc}") from exc
        cfg_file = os.path.join(path, "tokenizer_config.json")
        config = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}

        template = config.get("chat_template")
        if isinstance(template, list):  # the older named-templates form
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file, json_file = os.path.join(path, "chat_template.jinja"), os.path.join(path, "chat_template.json")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif template is None and os.path.isfile(json_file):
            template = _read_json(json_file).get("chat_template")

        def token_id(key):
            text = _token_content(config.get(key))
            return backend.token_to_id(text) if text is not None else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        # Llama 3's tokenizer.json already prepends BOS in its post-processor; only add what is missing.
        probe = backend.encode("a", add_special_tokens=True).ids
        prepend = bool(config.get("add_bos_token")) and bos is not None and probe[:1] != [bos]
        append = bool(config.get("add_eos_token")) and eos is not None and probe[-1:] != [eos]
        return cls(backend, vocab_size=backend.get_vocab_size(True), bos_token_id=bos, eos_token_id=eos,
                   chat_template=template, prepend_bos=prepend, append_eos=append)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self._bos, *ids]
        if add_special_tokens and self._append_eos:
            ids = [*ids, self._eos]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self._chat_template:
            raise InvalidRequestError("model has no chat template", param="messages")
        if self._compiled is None:
            try:
                self._compiled = _compile_template(self._chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise InvalidRequestError(f"model chat template is invalid: {exc}", param="messages") from exc
        bos = self.id_to_token(self._bos) if self._bos is not None else None
        eos = self.id_to_token(self._eos) if self._eos is not None else None
        variables = {"bos_token": bos, "eos_token": eos, **extra}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            # A template that trips over the request's shape is the caller's problem, not a server fault.
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas in O(1) work per token.

    Each step decodes only the window from `prefix_offset` (a few tokens of context, so that
    decoders which depend on neighbours see them) and compares it with the text the window
    already produced up to `read_offset`. A delta ending in U+FFFD is an incomplete UTF-8
    character, so it is held back until the next token completes it.
    """

    _CONTEXT = 5  # prompt tokens kept as left context, as vLLM does

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> str:
        if self._skip and token_id in self._tok.special_token_ids:
            return ""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        # Drop ids left of the new window so memory stays bounded on long generations.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._text += delta
        return delta
