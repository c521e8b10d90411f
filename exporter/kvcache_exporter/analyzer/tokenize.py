"""The model's own tokenizer for text traces: `tokenizer.json` (the `tokenizers` library) and the chat
template of `tokenizer_config.json` / `chat_template.jinja`, rendered as vLLM (transformers) renders it."""

from __future__ import annotations

import json
from pathlib import Path

APPROXIMATE_WARNING = (
    "analyze: no --tokenizer: text prompts use the simulator's approximate tokenizer, so token counts and "
    "block boundaries are approximate"
)


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ModelTokenizer:
    def __init__(self, path: str | Path) -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ValueError(
                f"--tokenizer needs the analyzer extra (pip install tokenizers jinja2): {err}"
            ) from err
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.bos, self.eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    def encode(self, text: str) -> list[int]:
        """A completion prompt: special tokens added as the tokenizer's post-processor says (BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ValueError(
                "the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        return self.template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A chat request: the rendered template, tokenized without adding special tokens again."""
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids


def _raise(message: str):
    raise ValueError(f"chat template: {message}")
