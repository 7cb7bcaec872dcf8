"""Fine-tuning examples as tokens plus a loss mask: ``prepare --format chat | prompt-response``.

    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    {"prompt": "2+2?", "response": "4"}                          # --format prompt-response
    {"system": "Be brief.", "prompt": "2+2?", "response": "4"}   # the system field is optional

The mask marks the tokens the loss counts: every assistant message's, nothing of the system or
user turns. With the model's chat template (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja`` beside it) the conversation is rendered as the model was tuned to see it,
and each assistant message's span is found by rendering the conversation up to it with and
without that message: the mask covers the tokens overlapping those spans (the template's own
end-of-turn tokens included, so the model learns to stop). A template that does not render a
conversation as the concatenation of its turns (one that rewrites earlier turns) is refused by
name. The template is untrusted text: it runs in Jinja's immutable sandbox.

Without a template the example is plain text: a prompt-response pair is ``prompt`` then
``response`` + EOS (both masked in); a conversation is ``<role>: <content>\\n`` per turn, the
assistant's content and an EOS after it masked in. Either way each example is one document of
the token stream, followed by EOS (counted only when it ends a response).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    read_tokenizer_config,
    token_text,
)
from hpctrain.errors import DataError

FORMATS = ("text", "chat", "prompt-response")
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ExampleFields:
    """Where an example's parts are in its JSON record."""

    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"
    system: str = "system"


def template_source(tokenizer_path: str | Path) -> str | None:
    """The chat template of the model folder a tokenizer belongs to, if it has one."""
    path = Path(tokenizer_path)
    folder = path if path.is_dir() else path.parent
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    """A Jinja chat template, rendered in the sandbox with the tokenizer's special tokens."""

    def __init__(self, source: str, config: dict[str, Any], name: str = "the chat template"):
        from jinja2.exceptions import TemplateError

        from hpctrain.data.bounded_jinja import BoundedSandbox

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        self.source = source
        self.name = name
        # As transformers renders them: {% break %} / {% continue %} are in use on the Hub.
        self._env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                                   extensions=["jinja2.ext.loopcontrols"])
        self._env.globals["raise_exception"] = raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

        # Hugging Face's tojson: no HTML escaping, unicode kept.
        def tojson(x: Any, indent: int | None = None) -> str:
            return json.dumps(x, ensure_ascii=False, indent=indent)

        self._env.filters["tojson"] = self._env.bounded(tojson)
        try:
            self._template = self._env.from_source(source)
        except TemplateError as e:
            raise DataError(f"{name} does not parse: {e}") from None
        except RecursionError:
            raise DataError(f"{name} is nested too deeply to compile") from None
        self._special = {k: token_text(v) or "" for k, v in config.items()
                         if k.endswith("_token")}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as text; DataError naming the template when it fails or goes over
        its time or size budget (``bounded_jinja``)."""
        from jinja2.exceptions import TemplateError

        from hpctrain.data.bounded_jinja import TemplateBudgetError

        try:
            return self._env.render(self._template, messages=messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **self._special)
        except TemplateBudgetError as e:
            raise DataError(f"{self.name} was stopped: {e}",
                            expected="a template that renders a conversation in well under "
                            "a second and a few times its size",
                            hint="use the model's own chat template, or --format "
                            "prompt-response without one") from None
        except TemplateError as e:
            raise DataError(f"{self.name} refused the conversation: {e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                MemoryError) as e:  # the template's own errors: its code, not ours
            raise DataError(f"{self.name} failed: {type(e).__name__}: "
                            f"{str(e)[:200]}") from None


def load_template(tokenizer: HFTokenizer | ByteTokenizer,
                  tokenizer_path: str | Path | None) -> ChatTemplate | None:
    """The chat template of ``tokenizer``'s model folder (None for bytes or without one)."""
    if not isinstance(tokenizer, HFTokenizer) or tokenizer_path is None:
        return None
    source = template_source(tokenizer_path)
    if not source:
        return None
    path = Path(tokenizer_path)
    folder = path if path.is_dir() else path.parent
    name = (f"the chat template {folder / TEMPLATE_FILE}" if (folder / TEMPLATE_FILE).is_file()
            else f"the chat template of {folder / 'tokenizer_config.json'}")
    return ChatTemplate(source, tokenizer.config, name)


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} is {type(value).__name__}, not text")
    return value


def conversation(record: Any, fmt: str, fields: ExampleFields, where: str
                 ) -> list[dict[str, str]]:
    """The record as a checked list of ``{"role", "content"}`` turns."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record is {type(record).__name__}, not a JSON object")
    if fmt == "prompt-response":
        for key in (fields.prompt, fields.response):
            if key not in record:
                raise DataError(f"{where}: record has no field {key!r}",
                                hint="name the fields with --prompt-field / --response-field")
        turns = [{"role": "user", "content": _text(record[fields.prompt], fields.prompt, where)},
                 {"role": "assistant",
                  "content": _text(record[fields.response], fields.response, where)}]
        if record.get(fields.system) is not None:
            turns.insert(0, {"role": "system",
                             "content": _text(record[fields.system], fields.system, where)})
        return turns
    messages = record.get(fields.messages)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: record has no list {fields.messages!r} of messages",
                        hint="name the field with --messages-field, or use "
                        "--format prompt-response")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: message {i} is {m!r}",
                            expected=f'{{"role": one of {", ".join(ROLES)}, "content": text}}')
        turns.append({"role": m["role"], "content": _text(m.get("content"), f"message {i}'s "
                                                          "content", where)})
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing of it "
                        "would be trained", hint="remove such records from the input")
    return turns


class ExampleEncoder:
    """Turns one record into (token ids, loss mask), as the module docstring describes."""

    def __init__(self, tokenizer: HFTokenizer | ByteTokenizer, fmt: str, fields: ExampleFields,
                 template: ChatTemplate | None):
        self.tok, self.fmt, self.fields, self.template = tokenizer, fmt, fields, template

    def encode(self, record: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask uint8 of 0/1) of one example, EOS appended."""
        turns = conversation(record, self.fmt, self.fields, where)
        if self.template is not None:
            ids, mask = self._templated(turns, where)
        elif self.fmt == "prompt-response":
            prompt = [t for t in turns if t["role"] != "assistant"]
            parts = [(self._ids("\n".join(t["content"] for t in prompt)), 0),
                     (self._ids(turns[-1]["content"]), 1),
                     (np.array([self.tok.eos_id]), 1)]
            ids, mask = _join(parts)
        else:
            parts = []
            for t in turns:
                if t["role"] == "assistant":
                    parts += [(self._ids("assistant: "), 0), (self._ids(t["content"]), 1),
                              (np.array([self.tok.eos_id]), 1), (self._ids("\n"), 0)]
                else:
                    parts.append((self._ids(f"{t['role']}: {t['content']}\n"), 0))
            ids, mask = _join(parts)
        if len(ids) == 0 or ids[-1] != self.tok.eos_id:
            ids, mask = np.append(ids, self.tok.eos_id), np.append(mask, 0)
        if not mask.any():
            raise DataError(f"{where}: the assistant's reply encodes to no tokens",
                            hint="remove records with empty responses from the input")
        return ids, mask.astype(np.uint8)

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text), dtype=np.int64)

    def _templated(self, turns: list[dict[str, str]], where: str
                   ) -> tuple[np.ndarray, np.ndarray]:
        assert self.template is not None and isinstance(self.tok, HFTokenizer)
        text = self.template.render(turns, add_generation_prompt=False)
        spans = []
        for i, t in enumerate(turns):
            if t["role"] != "assistant":
                continue
            before = self.template.render(turns[:i], add_generation_prompt=True)
            upto = self.template.render(turns[:i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(
                    f"{where}: the chat template does not render the conversation turn by turn "
                    f"(the text up to message {i} is not a prefix of the whole), so the "
                    "assistant's tokens cannot be found",
                    hint="use --format prompt-response, or a template without rewriting of "
                    "earlier turns")
            spans.append((len(before), len(upto)))
        ids, offsets = self.tok.encode_offsets(text)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.uint8)
        return ids.astype(np.int64), mask


def _join(parts: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([p for p, _ in parts]).astype(np.int64)
    mask = np.concatenate([np.full(len(p), m, dtype=np.uint8) for p, m in parts])
    return ids, mask


def chat_prompt(tokenizer: HFTokenizer | ByteTokenizer, template: ChatTemplate | None,
                prompt: str) -> list[int]:
    """The token ids that ask the model for an assistant reply to ``prompt``."""
    turns = [{"role": "user", "content": prompt}]
    if template is not None and isinstance(tokenizer, HFTokenizer):
        text = template.render(turns, add_generation_prompt=True)
        return tokenizer.encode_offsets(text)[0].tolist()
    return tokenizer.encode(f"user: {prompt}\nassistant: ").tolist()

