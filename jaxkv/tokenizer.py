"""Tokenizer: `tokenizers.Tokenizer` + the checkpoint's special ids + a jinja2 chat template.

Mirrors what transformers does with a tokenizer.json directory, without importing transformers:
special tokens come from tokenizer_config.json (strings or AddedToken dicts), generation_config.json and
config.json; the chat template is rendered in a sandboxed jinja2 environment with the helpers Hugging
Face templates expect (`raise_exception`, `strftime_now`, `tojson`, `bos_token`, `eos_token`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizerType


class ChatTemplateError(ValueError):
    """No chat template, or the template rejected the messages (raise_exception)."""


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint directory.

    `tokenizer_json` is a tokenizer.json path or an already built `tokenizers.Tokenizer`.
    """

    def __init__(
        self,
        tokenizer_json: str | Path | _HFTokenizerType,
        tokenizer_config: dict | None = None,
        generation_config: dict | None = None,
        model_config: dict | None = None,
        chat_template: str | None = None,
    ):
        from tokenizers import Tokenizer as _HFTokenizer

        # A built `tokenizers.Tokenizer` is taken as is: a GGUF file has a vocabulary, not a tokenizer.json.
        if isinstance(tokenizer_json, _HFTokenizer):
            self._tok = tokenizer_json
        else:
            self._tok = _HFTokenizer.from_file(str(tokenizer_json))
        self.config = dict(tokenizer_config or {})
        gen, mcfg = generation_config or {}, model_config or {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token, gen.get("bos_token_id", mcfg.get("bos_token_id")))
        self.pad_token_id = self._id(self.pad_token, gen.get("pad_token_id", mcfg.get("pad_token_id")))
        eos = _as_list(gen.get("eos_token_id"))
        tok_eos = self._id(self.eos_token, None)
        eos += [tok_eos] if tok_eos is not None else []
        eos += _as_list(mcfg.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.chat_template: str | None = template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja, generation/model config."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
        jinja = path / "chat_template.jinja"
        return cls(
            path / "tokenizer.json",
            _read_json(path / "tokenizer_config.json"),
            _read_json(path / "generation_config.json"),
            _read_json(path / "config.json"),
            jinja.read_text() if jinja.exists() else None,
        )

    def _id(self, token: str | None, fallback) -> int | None:
        if token is not None and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        return None if fallback is None else int(fallback)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens per the post-processor, then add_bos/eos_token if set."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if not add_special_tokens:
            return ids
        add_bos, add_eos = self.config.get("add_bos_token"), self.config.get("add_eos_token")
        bos = self.bos_token_id
        if bos is not None and add_bos is True and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        elif bos is not None and add_bos is False and ids and ids[0] == bos:
            ids.pop(0)
        eos = self._id(self.eos_token, None)
        if eos is not None and add_eos is True and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> str | list[int]:
        """Render `messages` with the checkpoint's chat template (text, or ids when tokenize=True).

        The rendered text already holds the template's special tokens, so tokenizing does not add more.
        """
        if not self.chat_template:
            raise ChatTemplateError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); pass plain prompts instead"
            )
        text = _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _raise_exception(message):
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same signature as transformers' filter (jinja's own tojson escapes HTML characters).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The sandboxed jinja2 template, compiled once per template text (compiling costs milliseconds:
    a server renders one per chat request)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
