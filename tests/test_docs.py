"""The configuration reference (docs/configuration.md) names every key the config models
accept, section by section: a key added to a model without its documentation fails here."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from stoker.server import _config as c
from stoker.server.formats import FORMATS
from stoker.server.formats._lake_config import LakeDataset
from stoker.server.formats.audio_config import AudioDataset
from stoker.server.formats.chat_config import ChatDataset, ChatImages
from stoker.server.formats.config_base import Sourced
from stoker.server.formats.delta_config import DeltaDataset
from stoker.server.formats.iceberg_config import IcebergDataset
from stoker.server.formats.image_config import TRANSFORMS
from stoker.server.formats.image_folder_config import ImageFolderDataset
from stoker.server.formats.jsonl_config import JsonField, JsonlDataset
from stoker.server.formats.lance_config import LanceDataset
from stoker.server.formats.litdata_config import LitdataDataset
from stoker.server.formats.mds_config import ColumnField, MdsDataset
from stoker.server.formats.memmap_config import MemmapDataset
from stoker.server.formats.mixture_config import MixtureComponent, MixtureDataset, MixtureStep
from stoker.server.formats.parquet_config import ParquetDataset, ParquetField
from stoker.server.formats.python_config import PythonDataset
from stoker.server.formats.tar_config import TarDataset, TarField
from stoker.server.formats.text_config import TextDataset
from stoker.server.formats.tokens_config import TokensDataset
from stoker.server.formats.video_config import ClipAudio, VideoDataset

pytestmark = pytest.mark.timeout(30)

DOC = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()

# model -> the heading of the section whose tables document its keys
SECTIONS: dict[type[BaseModel], str] = {
    c.ServerSettings: "### `server:`",
    c.TlsSettings: "### `server:`",
    c.S3Settings: "### `s3:`",
    c.CacheSettings: "### `cache:`",
    Sourced: "### `datasets:`",
    PythonDataset: "#### `format: python`",
    ImageFolderDataset: "#### `format: image-folder`",
    TarDataset: "#### `format: tar`",
    TarField: "#### `format: tar`",
    ParquetDataset: "#### `format: parquet`",
    ParquetField: "#### `format: parquet`",
    JsonlDataset: "#### `format: jsonl`",
    JsonField: "#### `format: jsonl`",
    TokensDataset: "#### `format: tokens`",
    TextDataset: "#### `format: text`",
    ChatDataset: "#### `format: chat`",
    ChatImages: "##### Images in conversations",
    MemmapDataset: "#### `format: memmap`",
    MdsDataset: "#### Migrating from Mosaic Streaming and LitData",
    LitdataDataset: "#### Migrating from Mosaic Streaming and LitData",
    ColumnField: "#### Migrating from Mosaic Streaming and LitData",
    MixtureDataset: "#### `format: mixture`",
    MixtureComponent: "#### `format: mixture`",
    MixtureStep: "#### `format: mixture`",
    VideoDataset: "#### `format: video`",
    ClipAudio: "#### `format: audio`",
    AudioDataset: "#### `format: audio`",
    LakeDataset: "#### Tables in lakes: Iceberg, Delta, Lance",
    IcebergDataset: "#### `format: iceberg`",
    DeltaDataset: "#### `format: delta`",
    LanceDataset: "#### `format: lance`",
}


def section(heading: str) -> str:
    start = DOC.index(heading)
    level = heading.split(" ")[0]
    nxt = re.compile(rf"^#{{2,{len(level)}}} ", re.M).search(DOC, start + len(heading))
    return DOC[start: nxt.start() if nxt else len(DOC)]


def documented(text: str) -> set[str]:
    """Keys named in the first column of the section's tables: | `key` | or | `a`, `b` |"""
    cells = re.findall(r"^\| ([^|]*) \|", text, re.M)
    return {key for cell in cells for key in re.findall(r"`([a-z_0-9]+)`", cell)}


@pytest.mark.parametrize("model", list(SECTIONS), ids=lambda m: m.__name__)
def test_every_key_of_the_model_is_in_its_section(model: type[BaseModel]) -> None:
    own = set(model.model_fields)
    if model is not Sourced:  # keys every dataset shares have the common table
        own -= documented(section(SECTIONS[Sourced])) & set(Sourced.model_fields)
    if issubclass(model, LakeDataset) and model is not LakeDataset:  # and the lakes theirs
        own -= documented(section(SECTIONS[LakeDataset])) | set(Sourced.model_fields)
    missing = sorted(own - documented(section(SECTIONS[model])) - {"format"})
    assert missing == [], f"{model.__name__}: not in {SECTIONS[model]!r}: {missing}"


def test_every_transform_and_its_arguments_are_documented() -> None:
    text = section("#### Transforms")
    for name, step in TRANSFORMS.items():
        assert f"| `{name}` |" in text, name
        args = step.model_fields[name].annotation  # pydantic strips the Annotated
        for arg in args.model_fields:
            assert f"`{arg}`" in text, f"{name}.{arg}"


def test_every_dataset_format_has_a_section() -> None:
    union = typing.get_args(c.DatasetConfig)[0]
    formats = {typing.get_args(m.model_fields["format"].annotation)[0]
               for m in typing.get_args(union)}
    assert len(formats) == len(FORMATS)
    for f in formats:
        assert f"#### `format: {f}`" in DOC, f
