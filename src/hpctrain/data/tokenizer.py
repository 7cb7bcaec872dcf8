"""Tokenizers for ``hpctrain data prepare``: built-in byte-level, or a HuggingFace tokenizer.json.

Both turn one document (``str`` or UTF-8 ``bytes``) into a numpy array of token ids; the caller
appends the EOS id. A tokenizer is named by a small picklable :class:`TokenizerSpec` so each
worker process loads its own copy once. A Hugging Face model folder may be named instead of its
tokenizer.json: its ``tokenizer_config.json`` then names the EOS token (and holds the chat
template `hpctrain.data.chat` uses).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.inputs import expand_inputs, read_documents
from hpctrain.data.shards import atomic_write
from hpctrain.errors import DataError

BYTE_EOS = 256
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Fixed text hashed as the byte tokenizer's identity: changing the mapping must change this.
_BYTE_ID = b"hpctrain byte-level tokenizer v1: id = byte value (0..255), EOS = 256"
# Tried in order when a tokenizer.json is given without --eos-token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer: ``"bytes"`` or the path of a tokenizer.json, and its EOS token."""

    kind: str = "bytes"
    path: str | None = None
    eos_token: str | None = None


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text; EOS = 256, so the vocabulary is 257 (uint16)."""

    name = "bytes"
    vocab_size = 257
    eos_id = BYTE_EOS

    def __init__(self) -> None:
        self.hash = "sha256:" + hashlib.sha256(_BYTE_ID).hexdigest()

    def encode(self, doc: str | bytes) -> np.ndarray:
        """Token ids of one document."""
        data = doc.encode("utf-8", errors="surrogatepass") if isinstance(doc, str) else doc
        return np.frombuffer(data, dtype=np.uint8)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (the bytes; nothing is added)."""
        return self.encode(text).tolist()

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (EOS and invalid UTF-8 replaced)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of a model folder ({} when there is none)."""
    path = Path(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}") from None
    return raw if isinstance(raw, dict) else {}


class NoEosToken(DataError):
    """A tokenizer in which no end-of-sequence token could be found."""


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer.json (optional dependency ``tokenizers``)."""

    def __init__(self, path: str, eos_token: str | None = None, eos_id: int | None = None):
        """``eos_token`` if given, else the folder's tokenizer_config.json's, else the token of
        ``eos_id`` (the model's ``eos_token_id``), else the first of EOS_CANDIDATES it has."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                f"tokenizer {path!r} needs the 'tokenizers' package, which is not installed",
                hint="pip install tokenizers  (or: pip install 'hpctrain[data]')",
            ) from None
        p = Path(path)
        if p.is_dir():  # a model folder: its tokenizer.json, EOS from tokenizer_config.json
            self.config = read_tokenizer_config(p)
            eos_token = eos_token or token_text(self.config.get("eos_token"))
            p = p / TOKENIZER_JSON
        else:
            self.config = read_tokenizer_config(p.parent)
        try:
            raw = p.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, Exception) as e:  # tokenizers raises plain Exception
            raise DataError(f"cannot load tokenizer {path!r}: {e}",
                            expected="a HuggingFace tokenizer.json") from None
        self.name = p.name
        self.hash = "sha256:" + hashlib.sha256(raw).hexdigest()
        # The id range, not the token count: a tokenizer.json may number its tokens sparsely, and
        # the dtype and the model's embedding must hold the largest id.
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if not eos_token and eos_id is not None:
            eos_token = self._tok.id_to_token(eos_id)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [(t, i) for t, i in zip(candidates, ids, strict=True) if i is not None]
        if not found:
            raise NoEosToken(
                f"tokenizer {path!r} has no EOS token among {', '.join(candidates)}",
                hint="name it with --eos-token TOKEN",
            )
        self.eos_token, self.eos_id = found[0]

    def encode(self, doc: str | bytes) -> np.ndarray:
        """Token ids of one document (no special tokens added)."""
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, ``[n, 2]`` character spans in ``text``); special tokens in the text are
        recognised, none are added."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return (np.asarray(enc.ids, dtype=np.uint32),
                np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt as the model expects one (its BOS and such added)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens left out."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(spec: TokenizerSpec) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``spec`` names."""
    if spec.kind == "bytes":
        return ByteTokenizer()
    return HFTokenizer(str(spec.path), spec.eos_token)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def train_bpe(inputs: list[str], out: str | Path, vocab_size: int, *, text_field: str = "text",
              eos_token: str = "<|endoftext|>", progress: bool = False,
              follow_symlinks: bool = False) -> Path:
    """Train a byte-level BPE tokenizer on ``inputs`` with ``tokenizers``; write tokenizer.json.

    Byte-level (GPT-2 style): every byte is in the alphabet, so any text encodes without unknown
    tokens; ``eos_token`` is added as a special token. ``vocab_size`` counts it and the 256 bytes.
    Inputs are found as `hpctrain.data.inputs` says (``follow_symlinks`` as there).
    """
    out = Path(out)
    if out.is_dir():
        raise DataError(f"--out {str(out)!r} is a directory", expected="a tokenizer.json path")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("training a tokenizer needs the 'tokenizers' package",
                        hint="pip install tokenizers  (or: pip install 'hpctrain[data]')") from None
    if vocab_size < 258:
        raise DataError(f"--vocab {vocab_size} is too small",
                        expected=">= 258 (256 bytes, the EOS token and at least one merge)")
    files = expand_inputs(list(inputs), follow_symlinks=follow_symlinks)

    def documents():
        for f in files:
            for doc in read_documents(f, text_field):
                yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the directory of --out {str(out)!r}: "
                        f"{e.strerror}") from None
    tok.train_from_iterator(documents(), trainer=trainer)
    atomic_write(out, [tok.to_str(pretty=True).encode()])
    return out
