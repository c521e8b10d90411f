"""The served model's tokenizer (`tokenizer.json`, the `tokenizers` library): loaded once for the
analyzer's text traces and for the sidecar's field naming (derive/fields.py), and a decoder that
never raises on hostile token ids."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

MAX_FILE_BYTES = 256 << 20
"""tokenizer.json and its config are read whole: a bigger file is not a tokenizer"""


def read_text(path: Path) -> str:
    """The file's text, read within MAX_FILE_BYTES whatever size it reports (a device such as
    /dev/zero reports 0 and never ends; a /proc file reports 0 too)."""
    try:
        with path.open("rb") as stream:
            if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
                raise ValueError(f"{path}: not a regular file: not a tokenizer file")
            data = stream.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB: not a tokenizer file")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: {err}") from None


def load_tokenizer(path: str | Path, needs: str = "tokenizers"):
    """`path`: a tokenizer.json or the model folder holding one; ValueError says what is wrong.
    `needs`: how the error tells the user to install the library."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ValueError(f"the tokenizer needs {needs}: {err}") from err
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_str(read_text(file))
    except ValueError:
        raise
    except Exception as err:  # the tokenizers library raises plain Exception for any bad file
        raise ValueError(f"{file}: not a tokenizer.json: {str(err)[:200]}") from None


def safe_decoder(tokenizer, max_tokens: int) -> Callable[[Sequence[int]], str]:
    """ids -> text, the first `max_tokens` only; ids outside the vocabulary (negative, huge, not an
    int) are skipped, special tokens dropped, undecodable bytes read as U+FFFD; never raises."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(ids: Sequence[int]) -> str:
        kept = [i for i in ids[:max_tokens] if type(i) is int and 0 <= i < vocab]
        try:
            return tokenizer.decode(kept, skip_special_tokens=True)
        except Exception:  # a broken decoder in the file: nothing decoded, nothing to name
            return ""

    return decode
