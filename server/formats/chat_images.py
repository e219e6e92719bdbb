"""Images inside conversations for `format: chat` (its `images:` block).

At open, `take_images` finds a record's images: the content parts `{"type": "image"}`, in
message order, each with its own `image` (or `path`) value, or else the next of the record's
`images.column` list. A value is a path (a string: a key under the dataset's source root,
read through its Storage), bytes (a parquet binary) or a `{"bytes", "path"}` struct (a
Hugging Face `Image()` column). The template sees a placeholder string instead of the value
(as transformers gives templates `<bytes>` for media); it writes `images.token` where an image
goes, and `expand` turns each such token into a block of `count` image tokens, never trained
on. A record whose template wrote another number of image tokens than it has images is bad.

At read time `Images.pixels` decodes and transforms a row's images with the image pipeline
(server/images.py), drawing from the row's generator in order, so a row is the same on any
worker. Thread-safe: the arrays are read-only, the pipeline is.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .chat_template import TemplateError

PATH, BYTES = 0, 1  # the kinds of a reference
PLACEHOLDER = "<image>"


def _ref(value: Any) -> tuple[int, bytes]:
    if isinstance(value, dict):  # a Hugging Face Image() struct
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, str) and value:
        return PATH, value.encode("utf-8")
    if isinstance(value, bytes | bytearray) and value:
        return BYTES, bytes(value)
    raise TemplateError(f"an image is a path, bytes or a {{bytes, path}} object, got "
                        f"{type(value).__name__}")


def take_images(messages: Any, column: Any) -> tuple[Any, list[tuple[int, bytes]]]:
    """(the messages with placeholders for the template, each image's reference in order)."""
    pool = list(column) if isinstance(column, list) else []
    if column is not None and not isinstance(column, list):
        raise TemplateError(f"the images column: expected a list, got {type(column).__name__}")
    if not isinstance(messages, list):
        return messages, []  # the template's checks name what is wrong
    refs: list[tuple[int, bytes]] = []
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    value = part.get("image", part.get("path"))
                    if value is None:
                        if not pool:
                            raise TemplateError(f"image {len(refs)}: the part holds no image "
                                                "and the images column has no more")
                        value = pool.pop(0)
                    refs.append(_ref(value))
                    part = {k: (PLACEHOLDER if k in ("image", "path") else v)
                            for k, v in part.items()}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    if pool:
        raise TemplateError(f"the images column holds {len(pool)} image(s) more than the "
                            "messages' image parts")
    return out, refs


def expand(ids: np.ndarray, trained: np.ndarray, token: int, count: int, images: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids with each image token repeated `count` times, their trained flags (0 on image
    tokens), each block's start)."""
    at = np.flatnonzero(ids == token)
    if len(at) != images:
        raise TemplateError(f"the template wrote {len(at)} image token(s) for {images} "
                            "image(s)")
    reps = np.where(ids == token, count, 1)
    new_ids, new_trained = np.repeat(ids, reps), np.repeat(trained, reps)
    new_trained[new_ids == token] = 0
    return new_ids, new_trained, at + (count - 1) * np.arange(len(at))


def output_shape(pipeline: Any) -> tuple[int, ...]:
    """The shape the pipeline gives every image (its config fixes one), from a tiny PNG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (127, 127, 127)).save(buf, format="PNG")
    return tuple(pipeline(buf.getvalue(), np.random.default_rng(0)).shape)


class Images:
    """A corpus's image references and the pipeline that turns them into pixels."""

    def __init__(self, storage: Any, pipeline: Any, shape: tuple[int, ...], refs: np.ndarray,
                 blob: np.ndarray, at: np.ndarray, offsets: np.ndarray) -> None:
        self.storage, self.pipeline, self.shape = storage, pipeline, shape
        self.refs, self.blob, self.at, self.offsets = refs, blob, at, offsets

    def of(self, conversation: int) -> range:
        return range(int(self.offsets[conversation]), int(self.offsets[conversation + 1]))

    def data(self, j: int) -> bytes:
        kind, start, end = (int(x) for x in self.refs[j])
        raw = self.blob[start:end].tobytes()
        return raw if kind == BYTES else self.storage.read(raw.decode("utf-8"))

    def pixels(self, images: list[int], rng: np.random.Generator) -> np.ndarray:
        """The images' pipeline outputs, [len(images), *shape], in order."""
        out = np.empty((len(images), *self.shape), np.dtype(self.pipeline.dtype))
        for k, j in enumerate(images):
            out[k] = self.pipeline(self.data(j), rng)
        return out
