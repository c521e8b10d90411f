"""The model's own tokenizer for text traces: `tokenizer.json` (the `tokenizers` library) and the chat
template of `tokenizer_config.json` / `chat_template.jinja`, rendered as vLLM (transformers) renders it."""

from __future__ import annotations

import json
from pathlib import Path

from ..model_tokenizer import load_tokenizer
from ..model_tokenizer import read_text as _read

APPROXIMATE_WARNING = (
    "analyze: no --tokenizer: text prompts use the simulator's approximate tokenizer, so token counts and "
    "block boundaries are approximate"
)


def _token_text(value) -> str:
    text = value.get("content", "") if isinstance(value, dict) else (value or "")
    return text if isinstance(text, str) else ""


class ModelTokenizer:
    def __init__(self, path: str | Path) -> None:
        try:
            from .chat_template import ChatTemplate
        except ImportError as err:
            raise ValueError(
                f"--tokenizer needs the analyzer extra (pip install tokenizers jinja2): {err}"
            ) from err
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        self.tokenizer = load_tokenizer(path, "the analyzer extra (pip install tokenizers jinja2)")
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(_read(config_path)) if config_path.is_file() else {}
        except (ValueError, RecursionError) as err:
            raise ValueError(f"{config_path}: not JSON: {str(err)[:200]}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: not a JSON object")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
        name = f"{config_path}:chat_template"
        if template is None and (folder / "chat_template.jinja").is_file():
            name = str(folder / "chat_template.jinja")
            template = _read(folder / "chat_template.jinja")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{config_path}: chat_template must be text")
        self.bos, self.eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        self.template = ChatTemplate(template, name, {"raise_exception": _raise}) if template else None

    def encode(self, text: str) -> list[int]:
        """A completion prompt: special tokens added as the tokenizer's post-processor says (BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ValueError(
                "the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        return self.template.render(  # bounded in time and output; a ValueError naming template and line
            messages=messages, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos
        )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A chat request: the rendered template, tokenized without adding special tokens again."""
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids


def _raise(message: str):
    raise ValueError(f"chat template: {message}")
