"""Text <-> token ids for GGUF and Hugging Face checkpoints, matching llama.cpp.

Encoding runs on the Hugging Face `tokenizers` library, configured the way llama.cpp
(src/llama-vocab.cpp) reads a GGUF vocabulary:

- "gpt2": byte-level BPE over the GGUF merges. Text is first split by the regexes that
  `tokenizer.ggml.pre` selects (applied one after another, keeping matches and gaps).
- "llama": SentencePiece BPE. llama.cpp merges adjacent pieces whenever their concatenation
  is a token, highest score first; that is plain BPE with one merge per (left, right) split of
  every token, ranked by the token's score. Characters outside the vocabulary fall back to
  <0xNN> byte tokens, and " " becomes "▁" with one "▁" prepended to the text and after every
  special token (add_space_prefix).
- "gemma4": SentencePiece-style BPE over the GGUF merges: " " becomes "▁" (no prefix), the text is split into lines
  and runs of newlines only, a run of newlines that is a token stays whole, and what no token covers falls back to
  <0xNN> byte tokens.

CONTROL, USER_DEFINED and UNKNOWN tokens are matched as whole units before any of that;
USER_DEFINED ones even when special-token parsing is off.

Decoding does not go through `tokenizers`: each id maps to its raw bytes, which is what a
streaming decoder needs when a token ends in the middle of a UTF-8 character.
"""

from __future__ import annotations

import codecs
import functools
import json
import numbers
import operator
import re
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator, NoReturn

import gguf
import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from workbench.errors import WorkbenchError

TokenType = gguf.TokenType
KEY = gguf.Keys.Tokenizer
SPACE_MARKER = "\u2581"  # SentencePiece's visible space, "▁"

# Tokens llama.cpp ends generation on, found by their text (src/llama-vocab.cpp), and makes CONTROL even when a GGUF
# mislabels them: the ends of turns, answers and texts of the chat formats it knows.
END_OF_GENERATION_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)
# Fill-in-the-middle tokens llama.cpp also ends generation on: per role, its GGUF key, else the first of its spellings
# in the vocabulary (made CONTROL).
FIM_STOP_TOKENS = (
    (KEY.FIM_PAD_ID, ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    (KEY.FIM_REP_ID, ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    (KEY.FIM_SEP_ID, ("<|file_sep|>",)),
)
# Stops llama.cpp drops again where other stops show the vocabulary uses them otherwise: the token, the type it gets,
# and the sets of stops any one of which drops it. gpt-oss's "<|end|>" ends a message (its reasoning, say), not the
# answer; Gemma 4's "</s>" is text.
DEMOTED_STOPS = (
    ("<|end|>", TokenType.USER_DEFINED, ({"<|return|>", "<|call|>"}, {"<|return|>", "<|calls|>"},
                                         {"<|call|>", "<|flush|>"}, {"<|calls|>", "<|flush|>"})),
    ("</s>", TokenType.NORMAL, ({"<|tool_response>"}, {"<|plamo:eos|>"})),
)
# gpt-oss's Harmony markers, which llama.cpp always renders (USER_DEFINED) for the reply's parser to see.
ALWAYS_RENDERED_TOKENS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# Tokens matched as units ahead of the BPE model (llama.cpp's "special tokens cache").
ADDED_TOKEN_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
# Tokens that decode(skip_special=True) leaves out; UNUSED ones never render.
HIDDEN_TOKEN_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-splits text for one family of `tokenizer.ggml.pre` values."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a pre-token that is itself a vocab token is kept whole
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


# Where llama.cpp rewrote a tokenizer.json regex for std::regex, the original is used here:
# the two are equivalent and Oniguruma (inside `tokenizers`) takes the original as is.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT_PRE = "default"
PRE_TOKENIZER_FAMILIES: tuple[tuple[tuple[str, ...], PreTokenizerSpec], ...] = (
    ((DEFAULT_PRE,), PreTokenizerSpec(
        (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"),
     PreTokenizerSpec((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizerSpec((LLAMA3_REGEX,))),
    (("gpt-2", "phi-2", "mpt", "olmo", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
      "gigachat", "exaone4"), PreTokenizerSpec((GPT2_REGEX,))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     PreTokenizerSpec((r"\p{N}", GPT2_REGEX))),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"),
     PreTokenizerSpec((QWEN2_REGEX,))),
    (("tekken",), PreTokenizerSpec((TEKKEN_REGEX,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizerSpec((GPT4O_REGEX,))),  # gpt-oss's o200k among them
    (("falcon",), PreTokenizerSpec(
        (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]"))),
)
PRE_TOKENIZERS = {name: spec for names, spec in PRE_TOKENIZER_FAMILIES for name in names}


class Tokenizer:
    """A model's vocabulary: encode/decode, special tokens and chat template.

    Build one with `from_gguf_metadata` or `from_hf_dir`. `space_prefix` says where the
    tokenizer adds a "▁" that is not in the text ("never", "first": at the start only,
    "always": at the start and after every special token), so decode can drop it again.
    `stop_ids` are the ids generation ends on (`_end_of_generation`).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        token_texts: list[str],
        token_types: list[int],
        *,
        byte_level: bool,
        space_prefix: str,
        bos_id: int | None,
        eos_id: int | None,
        add_bos_by_default: bool,
        chat_template: str | None,
        stop_ids: Iterable[int] = (),
    ) -> None:
        if space_prefix not in ("never", "first", "always"):
            raise ValueError(f"space_prefix must be 'never', 'first' or 'always', got {space_prefix!r}")
        self._backend = backend
        self.vocab_size = len(token_texts)
        # each token's bytes, rendered when first asked for (all 49k at load took a third of the load time)
        self._texts, self._types, self._byte_level = token_texts, token_types, byte_level
        self._pieces: dict[int, bytes] = {}
        self._added_ids = frozenset(i for i, kind in enumerate(token_types) if kind in ADDED_TOKEN_TYPES)
        self._hidden_ids = frozenset(i for i, kind in enumerate(token_types) if kind in HIDDEN_TOKEN_TYPES)
        self._space_prefix = space_prefix
        self.bos_id = self._check_optional_id(bos_id, "bos_id")
        self.eos_id = self._check_optional_id(eos_id, "eos_id")
        self.add_bos_by_default = add_bos_by_default and bos_id is not None
        self.chat_template = chat_template
        self.stop_ids: set[int] = {self._check_id(i) for i in stop_ids}

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF key/value metadata (values decoded, e.g. `field.contents()`)."""
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict of GGUF keys, got {type(metadata).__name__}")
        model = metadata.get(KEY.MODEL)
        if model not in ("gpt2", "llama", "gemma4"):
            raise ValueError(f"unsupported {KEY.MODEL} {model!r}: expected 'gpt2' (byte-level BPE), "
                             "'llama' (SentencePiece) or 'gemma4'")
        texts = _required_list(metadata, KEY.LIST, str)
        types = metadata.get(KEY.TOKEN_TYPE) or [TokenType.NORMAL] * len(texts)
        if len(types) != len(texts):
            raise ValueError(f"{KEY.TOKEN_TYPE} has {len(types)} entries for {len(texts)} tokens")
        vocab = {text: i for i, text in enumerate(texts)}
        if len(vocab) != len(texts):
            raise ValueError(f"{KEY.LIST} contains duplicate tokens")
        stop_ids, retyped = _end_of_generation(
            texts, [metadata[key] for key in (KEY.EOS_ID, KEY.EOT_ID, KEY.EOM_ID) if key in metadata], metadata)
        types = [retyped.get(i, kind) for i, kind in enumerate(types)]

        if model == "gpt2":
            merges = [_split_merge(merge) for merge in _required_list(metadata, KEY.MERGES, str)]
            spec = _pre_tokenizer_spec(metadata.get(KEY.PRE))
            backend = _bpe(vocab, merges, ignore_merges=spec.ignore_merges)
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            space_prefix, add_bos = "never", spec.add_bos
        elif model == "gemma4":
            merges = [_split_merge(merge) for merge in _required_list(metadata, KEY.MERGES, str)]
            # llama.cpp keeps a run of newlines that is a token whole; a whole line that is a token comes out of the
            # merges the same way in a vocabulary the merges built
            backend = _bpe(vocab, merges, byte_fallback=True, ignore_merges=True)
            backend.normalizer = normalizers.Replace(" ", SPACE_MARKER)
            backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
            space_prefix, add_bos = "never", True
        else:
            scores = _required_list(metadata, KEY.SCORES, int, float)
            if len(scores) != len(texts):
                raise ValueError(f"{KEY.SCORES} has {len(scores)} entries for {len(texts)} tokens")
            unk_id = metadata.get(KEY.UNK_ID)
            backend = _bpe(vocab, _merges_from_scores(texts, scores), byte_fallback=True,
                           unk_token=texts[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(texts) else None)
            escape_spaces = normalizers.Replace(" ", SPACE_MARKER)
            # Normalizers run on each stretch of text between added tokens, which is exactly
            # where llama.cpp prepends its space.
            if metadata.get(KEY.ADD_PREFIX, True):
                backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER), escape_spaces])
                space_prefix = "always"
            else:
                backend.normalizer = escape_spaces
                space_prefix = "never"
            add_bos = True

        special = [i for i, kind in enumerate(types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
        user_defined = [i for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED]
        backend.add_special_tokens([AddedToken(texts[i], special=True, normalized=False) for i in special])
        backend.add_tokens([AddedToken(texts[i], special=False, normalized=False) for i in user_defined])
        return cls(
            backend, texts, types,
            byte_level=model == "gpt2",
            space_prefix=space_prefix,
            bos_id=metadata.get(KEY.BOS_ID),
            eos_id=metadata.get(KEY.EOS_ID),
            add_bos_by_default=metadata.get(KEY.ADD_BOS, add_bos),
            chat_template=metadata.get(KEY.CHAT_TEMPLATE),
            stop_ids=stop_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Build from a Hugging Face checkpoint directory (tokenizer.json + tokenizer_config.json)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust library raises a bare Exception on a malformed file
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {str(err)[:200]}") from None
        backend.no_padding()
        backend.no_truncation()
        tokenizer_json = json.loads(tokenizer_file.read_text(encoding="utf-8"))
        config = _read_json(path / "tokenizer_config.json")
        # transformers' generate ends on generation_config.json's eos_token_id (an id, a list or null), else on
        # config.json's
        eos_ids = (_read_json(path / "generation_config.json").get("eos_token_id")
                   or _read_json(path / "config.json").get("eos_token_id") or [])

        byte_level = bool(_nodes_of_type(tokenizer_json.get("pre_tokenizer"), "ByteLevel")
                          or _nodes_of_type(tokenizer_json.get("decoder"), "ByteLevel"))
        vocab = backend.get_vocab(with_added_tokens=True)
        if not vocab or max(vocab.values()) >= 4 * len(vocab) + 1024:  # the id table is allocated up to the largest id
            raise ValueError(f"{tokenizer_file} has {len(vocab)} tokens with ids up to {max(vocab.values(), default=0)}")
        texts = [""] * (max(vocab.values()) + 1)
        types = [TokenType.UNUSED] * len(texts)  # ids missing from tokenizer.json render as nothing
        for text, i in vocab.items():
            texts[i] = text
            types[i] = TokenType.BYTE if not byte_level and BYTE_TOKEN.fullmatch(text) else TokenType.NORMAL
        for i, token in backend.get_added_tokens_decoder().items():
            types[i] = TokenType.CONTROL if token.special else TokenType.USER_DEFINED

        bos_id = _token_id(vocab, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no flag: trust the post-processor, as transformers does
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        eos_id = _token_id(vocab, config.get("eos_token"))
        declared = [*(eos_ids if isinstance(eos_ids, list) else [eos_ids]), *([] if eos_id is None else [eos_id])]
        return cls(
            backend, texts, types,
            byte_level=byte_level,
            space_prefix=_hf_space_prefix(tokenizer_json),
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos_by_default=bool(add_bos),
            chat_template=_hf_chat_template(path, config),
            stop_ids=_end_of_generation(texts, declared, {})[0],  # the types are tokenizer.json's
        )

    def to_hf_json(self) -> str:
        """The vocabulary as a Hugging Face tokenizer.json document."""
        return self._backend.to_str()

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_bos=None follows the model's default.

        parse_special=False reads CONTROL tokens such as "<|im_start|>" as plain text
        (user-defined tokens still match), as llama.cpp does for untrusted input.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if add_bos is None:
            add_bos = self.add_bos_by_default
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True but this vocabulary has no BOS token")
        self._backend.encode_special_tokens = not parse_special
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and ids[:1] == [self.bos_id]:  # llama.cpp warns the same
            warnings.warn("the text starts with the BOS token and add_bos adds a second one; encode a text that "
                          "carries its own (a rendered chat template, say) with add_bos=False", stacklevel=2)
        return [self.bos_id, *ids] if add_bos else ids

    def pad_to(self, vocab_size: int) -> None:
        """Ids up to ``vocab_size`` where the model's embedding has rows past the tokenizer's last token (Qwen's
        Hugging Face checkpoints pad it to a multiple of 128 or more): unused tokens that encode never gives and that
        decode to nothing, as llama.cpp's converter writes them (``[PAD<id>]``)."""
        extra = range(self.vocab_size, vocab_size)
        if extra:  # most models' tokenizers cover their embedding: no copy of the vocabulary at every load
            self._texts = [*self._texts, *(f"[PAD{i}]" for i in extra)]
            self._types = [*self._types, *(TokenType.UNUSED for _ in extra)]
            self.vocab_size = vocab_size

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`, undoing encode exactly (including the SentencePiece space prefix).

        skip_special drops CONTROL/UNKNOWN tokens such as BOS or "<|im_end|>".
        """
        pieces = []
        at_prefix_point = self._space_prefix != "never"  # the start of the text
        for n, token_id in enumerate(ids):
            token_id = self._check_id(token_id)
            piece = self._piece(token_id)
            if token_id in self._added_ids:
                # the BOS that encode puts before the text leaves the text's start (and its prefix) after it
                at_prefix_point = self._space_prefix == "always" or (at_prefix_point and n == 0
                                                                     and token_id == self.bos_id)
                if skip_special and token_id in self._hidden_ids:
                    continue
            elif at_prefix_point:
                piece = piece.removeprefix(b" ")
                at_prefix_point = False
            pieces.append(piece)
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token stands for; may be part of a UTF-8 character."""
        return self._piece(self._check_id(token_id))

    def _piece(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = _piece_bytes(self._texts[token_id], self._types[token_id],
                                                          self._byte_level)
        return piece

    def token_text(self, token_id: int) -> str:
        """Readable piece of one token, e.g. " Paris"; a partial character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_hidden(self, token_id: int) -> bool:
        """Whether decode(skip_special=True) drops this token (CONTROL/UNKNOWN)."""
        return self._check_id(token_id) in self._hidden_ids

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str:
        """Render the model's jinja chat template for `messages` (dicts with role and content), in a sandbox with
        limits on time and size: a template that loops or builds huge strings is refused with a ChatTemplateError.
        ``continue_final_message`` leaves the last message open for the model to continue (a prefilled answer), as
        transformers' option of that name does: no generation prompt, and what the template writes after the
        message's text (its end of turn) cut off."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer.chat_template is missing)")
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for n, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"messages[{n}] must be a dict, got {type(message).__name__}")
            if not isinstance(message.get("role"), str) or "content" not in message:
                raise ValueError(f"messages[{n}] needs a string 'role' and a 'content'")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt exclude each other")
            if not messages or not isinstance(messages[-1]["content"], str):
                raise ValueError("continue_final_message needs a last message whose content is a string")
            # transformers' way: mark where the message's text ends, render, and cut there
            messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        content = sum(len(str(m["content"])) for m in messages)
        rendered = _render_limited(self._compiled_chat_template, TEMPLATE_OUTPUT_CHARS + 4 * content,
                                   messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self._special_text(self.bos_id), eos_token=self._special_text(self.eos_id))
        if not continue_final_message:
            return rendered
        end = rendered.rfind(_CONTINUE_TAG.strip())
        if end < 0:
            raise ChatTemplateError(f"message {len(messages) - 1}: the chat template drops the text of the message "
                                    "to continue")
        # a template that trims the message (Llama 3's "| trim") trimmed the tag's space too: trim the text alike
        return rendered[:end] if rendered.startswith(_CONTINUE_TAG, end) else rendered[:end].rstrip()

    @functools.cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if not isinstance(self.chat_template, str) or len(self.chat_template) > TEMPLATE_SOURCE_CHARS:
            raise ChatTemplateError(f"the chat template is not a text of at most {TEMPLATE_SOURCE_CHARS:,} characters")
        with _guarded(TEMPLATE_OUTPUT_CHARS, "does not compile"):
            return _chat_template_env().from_string(self.chat_template)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_text(token_id)

    def _check_id(self, token_id: Any) -> int:
        return _checked_id(token_id, self.vocab_size)

    def _check_optional_id(self, token_id: Any, name: str) -> int | None:
        if token_id is None:
            return None
        try:
            return self._check_id(token_id)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None


class StreamDecoder:
    """Incremental decoding for generation: feed ids as they come, get the newly completed text.

    Bytes of a character split over several tokens (emoji, CJK in byte-fallback vocabularies)
    are held back until the character is whole. Pieces are emitted as is: the SentencePiece
    space prefix is not stripped, since streamed tokens continue a prompt.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text they complete (possibly "")."""
        if isinstance(token_ids, numbers.Integral):
            token_ids = [token_ids]
        shown = (i for i in token_ids if not (self._skip_special and self._tokenizer.is_hidden(i)))
        return self._utf8.decode(b"".join(self._tokenizer.token_bytes(i) for i in shown))

    def flush(self) -> str:
        """Text still held back at the end; an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _checked_id(token_id: Any, vocab_size: int) -> int:
    if isinstance(token_id, bool):
        raise TypeError("token ids must be integers, got bool")
    try:
        token_id = operator.index(token_id)  # also numpy / 0-d torch integers
    except TypeError:
        raise TypeError(f"token ids must be integers, got {type(token_id).__name__}") from None
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id


def _end_of_generation(texts: list[str], declared: Iterable[Any], metadata: dict[str, Any]
                       ) -> tuple[set[int], dict[int, int]]:
    """The ids generation ends on, as llama.cpp finds them (src/llama-vocab.cpp), and the token types it sets on the
    way.

    They are the `declared` ids (EOS, EOT, EOM; a generation_config's eos_token_id), each fill-in-the-middle role's id
    (FIM_STOP_TOKENS: its key in the GGUF `metadata`, else found by text) and the END_OF_GENERATION_TOKENS; those found
    by text become CONTROL. A stop the others show to be text is dropped again (DEMOTED_STOPS), and gpt-oss's Harmony
    markers always render (USER_DEFINED)."""
    id_of = {text: i for i, text in enumerate(texts)}
    stops = {_checked_id(i, len(texts)) for i in declared}
    found = {id_of[text] for text in END_OF_GENERATION_TOKENS if text in id_of}
    for key, spellings in FIM_STOP_TOKENS:
        if key in metadata:
            stops.add(_checked_id(metadata[key], len(texts)))
        elif spelled := [id_of[text] for text in spellings if text in id_of]:
            found.add(min(spelled))
    types = dict.fromkeys(found, TokenType.CONTROL)
    stops |= found
    stop_texts = {texts[i] for i in stops}
    for text, kind, shown_by in DEMOTED_STOPS:
        if text in stop_texts and any(others <= stop_texts for others in shown_by):
            stops.discard(id_of[text])
            types[id_of[text]] = kind
    types.update((id_of[text], TokenType.USER_DEFINED) for text in ALWAYS_RENDERED_TOKENS if text in id_of)
    return stops, types


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE(vocab, merges, **options))
    except Exception as err:  # the Rust library raises a bare Exception, e.g. on a merge of an unknown token
        raise ValueError(f"invalid BPE vocabulary: {str(err)[:200]}") from None


def _piece_bytes(text: str, token_type: int, byte_level: bool) -> bytes:
    """What one token stands for, as llama.cpp's token_to_piece renders it."""
    if token_type in ADDED_TOKEN_TYPES:
        return text.encode()
    if token_type == TokenType.UNUSED:
        return b""
    if token_type == TokenType.BYTE and (match := BYTE_TOKEN.fullmatch(text)):
        return bytes([int(match.group(1), 16)])
    if byte_level:
        byte_of_char = _byte_level_alphabet()
        return b"".join(bytes([byte_of_char[c]]) if c in byte_of_char else c.encode() for c in text)
    return text.replace(SPACE_MARKER, " ").encode()


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte: printable bytes stand for themselves,
    the rest are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet


def _pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec:
    if name in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[name]
    # llama.cpp itself uses "default" when the key is missing (and rejects unknown names);
    # falling back keeps unknown models usable at some cost in fidelity.
    warnings.warn(f"{KEY.PRE} {name!r} is not known here; splitting text with llama.cpp's "
                  f"'{DEFAULT_PRE}' regexes, so tokens may differ from the original tokenizer",
                  stacklevel=3)
    return PRE_TOKENIZERS[DEFAULT_PRE]


def _split_merge(merge: str) -> tuple[str, str]:
    # Split at the first space after position 0, as llama.cpp does (a token may start with " ").
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed BPE merge {merge!r}: expected 'left right'")
    return merge[:cut], merge[cut + 1:]


def _merges_from_scores(texts: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece's score-driven merging expressed as ranked BPE merges."""
    vocab = set(texts)
    ranked = []
    for text, score in zip(texts, scores):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, left, right))
    ranked.sort(key=operator.itemgetter(0))  # stable: equal scores keep vocabulary order
    return [(left, right) for _, left, right in ranked]


def _required_list(metadata: dict[str, Any], key: str, *item_types: type) -> list:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(item, item_types) for item in value):
        names = " or ".join(item_type.__name__ for item_type in item_types)
        raise ValueError(f"GGUF metadata needs {key} as a list of {names}")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(vocab: dict[str, int], token: str | dict | None) -> int | None:
    """Id of a tokenizer_config.json token entry (a string or an AddedToken dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def _nodes_of_type(node: Any, type_name: str) -> list[dict]:
    """All objects with "type": type_name inside a tokenizer.json component."""
    if isinstance(node, list):
        return [found for child in node for found in _nodes_of_type(child, type_name)]
    if not isinstance(node, dict):
        return []
    children = [found for child in node.values() for found in _nodes_of_type(child, type_name)]
    return [node, *children] if node.get("type") == type_name else children


def _hf_space_prefix(tokenizer_json: dict[str, Any]) -> str:
    """Where a tokenizer.json adds a "▁" that is not in the text (see Tokenizer)."""
    if any(node.get("prepend") == SPACE_MARKER for node in _nodes_of_type(tokenizer_json.get("normalizer"), "Prepend")):
        return "always"  # normalizers run after every added token
    for node in _nodes_of_type(tokenizer_json.get("pre_tokenizer"), "Metaspace"):
        if "prepend_scheme" in node:
            return node["prepend_scheme"]
        return "always" if node.get("add_prefix_space", True) else "never"
    return "never"


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((entry["template"] for entry in template if entry.get("name") == "default"), None)
    return template


# appended to a message to continue, to find where its text ends in the rendering (transformers' tag)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(WorkbenchError, ValueError):
    """A chat template that is missing, does not compile, fails, or exceeds the limits on rendering it."""


TEMPLATE_SOURCE_CHARS = 1 << 20  # real templates are a few KiB
TEMPLATE_OUTPUT_CHARS = 1 << 20  # besides 4x the messages' text
TEMPLATE_SECONDS = 5.0  # real templates render in milliseconds
_FORMAT_WIDTH = re.compile(r"\d{7,}")  # a width or precision of millions of characters in a format string


def _raise_template_error(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template error: {str(message)[:200]}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _RuntimeOnlyCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja evaluates constant expressions while compiling ({{ 'a'|center(10**9) }} would be built there, outside
    any limit, and its errors swallowed); this compiles everything but literal text to run at render time."""

    def _output_child_to_const(self, node, frame, finalize):
        if not isinstance(node, (jinja2.nodes.TemplateData, jinja2.nodes.Const)):
            raise jinja2.nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox (no attribute access outside the safe set, no mutation) with bounded operations: string and list
    repetition, powers and format widths that would build huge values are refused before they are built."""

    intercepted_binops = frozenset(["*", "**", "%"])
    code_generator_class = _RuntimeOnlyCodeGenerator  # with optimized=False: nothing evaluated at compile time

    def call_binop(self, context, operator, left, right):
        limit = _limit()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                    raise ChatTemplateError(f"the chat template builds a value of {len(seq) * n:,} items; the limit is "
                                            f"{limit:,}")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise ChatTemplateError(f"the chat template raises to the power {right}; refused")
        if operator == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
            raise ChatTemplateError("the chat template formats with a width of millions of characters; refused")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        limit = _limit()
        if any(isinstance(v, int) and abs(v) > limit for v in (*args, *kwargs.values())):
            raise ChatTemplateError("the chat template passes a number beyond its size limit to a function; refused")
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", None) in ("format", "format_map") and isinstance(
                getattr(method, "__self__", None), str) and _FORMAT_WIDTH.search(method.__self__):
            raise ChatTemplateError("the chat template formats with a width of millions of characters; refused")
        return super().call(__context, __obj, *args, **kwargs)


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``, which marks the assistant's text for its training masks
    (return_assistant_tokens_mask); rendered as the text inside, in a scope of its own, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


_render_budget = threading.local()


def _limit() -> int:
    return getattr(_render_budget, "chars", TEMPLATE_OUTPUT_CHARS)


def _render_limited(template: jinja2.Template, limit: int, **variables: Any) -> str:
    """Render with a deadline and a size limit (``_guarded``); the output is also checked as it streams."""
    pieces, size = [], 0
    with _guarded(limit, "failed"):
        for piece in template.generate(**variables):
            size += len(piece)
            if size > limit:
                raise ChatTemplateError(f"the chat template renders more than {limit:,} characters; refused")
            pieces.append(piece)
    return "".join(pieces)


@contextmanager
def _guarded(limit: int, failing: str) -> Iterator[None]:
    """Run template code (rendering, or compiling, which evaluates constant filter calls) under a deadline and a size
    limit. A tracer checks the clock on every line a template runs (a loop that emits nothing still runs lines) and
    the sizes passed to every string join and filter, so a template can neither hang nor grow to gigabytes. Any
    failure comes out as a ChatTemplateError."""
    deadline = time.monotonic() + TEMPLATE_SECONDS
    joins = (jinja2.runtime.str_join.__code__, jinja2.runtime.markup_join.__code__)
    refusals: list[str] = []  # kept: an error raised in a tracer also switches the tracer off, and code may catch it

    def refuse(reason: str) -> NoReturn:
        refusals.append(reason)
        raise ChatTemplateError(reason)

    def check_time() -> None:
        if time.monotonic() > deadline:
            refuse(f"the chat template ran longer than {TEMPLATE_SECONDS:g} s; refused")

    def on_line(frame, event, arg):
        check_time()
        return on_line

    def on_call(frame, event, arg):
        check_time()
        if frame.f_code in joins:
            size = sum(len(v) for v in frame.f_locals.get("seq", ()) if isinstance(v, str))
            if size > limit:
                refuse(f"the chat template builds a string of {size:,} characters; the limit is {limit:,}")
        elif frame.f_code is _tojson.__code__ or frame.f_globals.get("__name__") == "jinja2.filters":
            values = frame.f_locals.values()
            if any(isinstance(v, int) and abs(v) > limit for v in values) or any(
                    isinstance(v, str) and "%" in v and _FORMAT_WIDTH.search(v) for v in values):
                refuse("the chat template passes a size beyond its limit to a filter; refused")
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    _render_budget.chars = limit
    sys.settrace(on_call)
    try:
        yield
        if refusals:
            raise ChatTemplateError(refusals[0])
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as err:
        raise ChatTemplateError(f"the chat template {failing}: {type(err).__name__}: {str(err)[:200]}") from None
    finally:
        sys.settrace(previous)
        del _render_budget.chars


@functools.cache
def _chat_template_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers' apply_chat_template, which the templates are written for.
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=["jinja2.ext.loopcontrols", _GenerationBlocks], optimized=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
