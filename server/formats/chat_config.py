"""The config model of `format: chat` (read by formats/chat.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, model_validator

from .config_base import RelativeToConfig, Sourced, Strict, TokenId, relative_to_config
from .image_config import ImageSize, Transforms, size_or_transforms


def _tokenizer_json(v: str) -> str:
    path = Path(v).expanduser()
    if path.suffix != ".json":
        raise ValueError(f"expected a Hugging Face tokenizer file (*.json), got {v!r}")
    if not path.is_file():
        raise ValueError(f"tokenizer file not found: {path}")
    return str(path)


# A local tokenizer.json, relative to the config file; its tokenizer_config.json beside it.
ChatTokenizer = Annotated[str, AfterValidator(_tokenizer_json), RelativeToConfig]


def _template(v: str | None) -> str | None:
    # A value without a Jinja tag that names a .jinja file is the file; anything else is inline.
    if v is None or "{" in v:
        return v
    path = Path(v).expanduser()
    if path.suffix not in (".jinja", ".j2", ".jinja2"):
        raise ValueError("expected inline Jinja text (with {{ }} or {% %}) or a .jinja file, "
                         f"got {v!r}")
    if not path.is_file():
        raise ValueError(f"chat_template file not found: {path}")
    return str(path)


def _template_path(v: Any, info: ValidationInfo) -> Any:
    if isinstance(v, str) and "{" in v:  # inline text is not a path
        return v
    return relative_to_config(v, info)


# Inline Jinja text, or a .jinja file (relative to the config file).
ChatTemplate = Annotated[str | None, AfterValidator(_template), BeforeValidator(_template_path)]


class ChatImages(Strict):
    """Images inside conversations: content parts {"type": "image", "image": PATH or bytes}
    (or images from `column`), each decoded and transformed on the server, its place in the
    text (`token`, as the template writes it) expanded to a block of image tokens.

    Attributes:
        token: The text the template writes for an image part (`<image>`); must be one token of the
            tokenizer (an added token).
        tokens: >= 1; image tokens per image.
        patch: >= 1; instead of `tokens`: `(height // patch) x (width // patch)` tokens of the
            transformed image.
        size: A plain resize to exactly that size.
        transforms: The image pipeline, as for images elsewhere (Transforms); it must give every
            image one size.
        column: A list of images beside the messages (a dotted path in `.jsonl`, a column in
            `.parquet`), used in order by the image parts that hold no image of their own (Hugging
            Face's `images` column layout).
    """

    token: str = Field(min_length=1, description="the text the template writes for an image "
                       "(one token of the tokenizer, e.g. <image>)")
    tokens: int | None = Field(None, ge=1, description="image tokens per image")
    patch: int | None = Field(None, ge=1, description="or: (height // patch) x (width // "
                              "patch) tokens, from the transformed image's size")
    size: ImageSize | None = None
    transforms: Transforms | None = None
    column: str | None = Field(None, min_length=1, description="a list of images beside the "
                               "messages, for image parts that hold none")
    layout: ClassVar[str] = "chw"  # what server/images.py reads of an image block

    @model_validator(mode="after")
    def _one_each(self) -> ChatImages:
        if (self.tokens is None) == (self.patch is None):
            raise ValueError("give either tokens (per image) or patch, not both or neither")
        size_or_transforms(self.size, self.transforms)
        if self.size is None and self.transforms is None:
            raise ValueError("give size or transforms: every image needs the same shape")
        return self


class ChatDataset(Sourced):
    """Conversations (a list of {role, content} messages in a field of .jsonl records or a
    column of .parquet files), rendered through a chat template, tokenized and masked once at
    open, and packed whole into rows of seq_len tokens (see formats/chat.py).

    Attributes:
        format: `"chat"`: selects this model (the key every dataset gives).
        field: `.jsonl`: a dotted path in each record to the list of messages; `.parquet`: a
            `list<struct<role, content>>` column.
        tokenizer: A Hugging Face `tokenizer.json`; the `tokenizer_config.json` beside it gives
            `chat_template` and the special tokens (`bos_token`, `eos_token`, `pad_token`, ...), as
            `transformers` saves them.
        chat_template: Inline Jinja text (anything with `{`), or a `.jinja` / `.j2` file relative to
            the config file; replaces the tokenizer config's.
        loss_on: The tokens trained on: every assistant turn, the last one only, or every token.
        end_of_turn: The token (its text or id) that ends the template's turns where it is not
            the tokenizer config's `eos_token` (Llama 3's `<|eot_id|>`, Gemma's
            `<end_of_turn>`): without `{% generation %}` markers an assistant span ends right
            after it.
        seq_len: >= 2; tokens per row.
        pack: `true`: whole conversations packed into rows; `false`: one conversation a row, padded.
        long: A conversation longer than `seq_len`: its first `seq_len` tokens, left out, or cut
            into pieces of `seq_len` tokens placed like conversations.
        pad_id: The id after a row's real tokens.
        shuffle: `global` only: rows have no shards.
        images: Images inside conversations: see below.
    """

    format: Literal["chat"]
    field: str = Field("messages", min_length=1,
                       description="jsonl: a dotted path in each record; parquet: a column")
    tokenizer: ChatTokenizer = Field(description="a tokenizer.json (Hugging Face tokenizers); "
                                     "its tokenizer_config.json beside it gives chat_template "
                                     "and the special tokens")
    chat_template: ChatTemplate = Field(
        None, description="inline Jinja text or a .jinja file; default: tokenizer_config.json's")
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    end_of_turn: str | TokenId | None = Field(
        None, description="the token (its text or id) that ends the template's turns, where "
        "it is not the tokenizer config's eos_token (Llama 3's <|eot_id|>, Gemma's "
        "<end_of_turn>): without {% generation %} markers an assistant span ends right after "
        "it")
    seq_len: int = Field(ge=2)
    pack: bool = True
    long: Literal["truncate", "drop", "split"] = "truncate"
    pad_id: TokenId | None = None  # default: the tokenizer's PAD, else its EOS, else 0
    shuffle: Literal["global"] = "global"  # rows have no shards
    images: ChatImages | None = None

    uses_cache_dir: ClassVar[bool] = True  # the rendered, tokenized conversations
