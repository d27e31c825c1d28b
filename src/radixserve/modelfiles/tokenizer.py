"""What the rest of the engine knows about a model without its weights: tokenizer, chat template,
special token ids and context length. Torch-free, so the API process can load it cheaply.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class ModelInfo:
    """A tokenizer plus the facts about its model that serving needs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        context_length: int,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.name = name
        self._template: Any = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor
        adds (a BOS for Llama). Chat-templated text already carries it: pass False there."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render OpenAI-style ``messages`` with the model's Jinja chat template; ``extra``
        (``tools=...``, ...) is passed to the template as variables."""
        if not self.chat_template:
            raise ValueError(f"model {self.name or '?'} has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            **extra,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def fingerprint(self) -> str:
        """Equal for tokenizers that turn every prompt and chat into the same ids: a digest of
        the tokenizer's full definition, its chat template and special ids. A router compares
        it with its workers' (/get_model_info) before it hashes prompts on their behalf."""
        parts = [self.tokenizer.to_str(), self.chat_template or "", repr(self.bos_token_id)]
        digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
        return f"hf:{digest}"

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""


def _compile_template(source: str) -> Any:
    """Compile in a sandbox with the options and helpers HF chat templates are written for."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def load_model_info(
    model_dir: str | Path, context_length: int | None = None, name: str | None = None
) -> ModelInfo:
    """Read tokenizer.json, tokenizer_config.json, config.json and generation_config.json of an
    HF directory; ``context_length`` overrides the model's own. ``name`` is the model's (see
    ``locate.model_name``; a converted GGUF's directory must be given one), else the directory's."""
    root = Path(model_dir)
    config = _read_json(root / "config.json")
    tok_config = _read_json(root / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = _ids(config.get("eos_token_id")) + _ids(
        _read_json(root / "generation_config.json").get("eos_token_id")
    )
    eos += _ids(_token_id(tokenizer, tok_config.get("eos_token")))
    bos = config.get("bos_token_id")
    if bos is None:
        bos = _token_id(tokenizer, tok_config.get("bos_token"))
    return ModelInfo(
        tokenizer,
        vocab_size=int(config["vocab_size"]),
        context_length=context_length or int(config.get("max_position_embeddings", 4096)),
        eos_token_ids=eos,
        bos_token_id=bos,
        chat_template=_chat_template(root, tok_config),
        name=root.name if name is None else name,
    )


def _chat_template(root: Path, tok_config: Mapping[str, Any]) -> str | None:
    # transformers v5 saves the template as its own file; v4 keeps it in tokenizer_config.json
    path = root / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # AddedToken serialised by transformers
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None
