"""Class folders: `<class>/<file>` under a source, each file labelled by its folder, as
torchvision's ImageFolder does (image_folder.py, video.py, audio.py)."""

from __future__ import annotations

from ..sources import Storage


def class_folders(storage: Storage, pattern: str | None, extensions: tuple[str, ...]
                  ) -> tuple[list[str], list[int]]:
    """The files with one of `extensions` (lower case) one folder down, and each one's label:
    its folder's index among the folder names, sorted."""
    keys = [o.key for o in storage.list(pattern)
            if o.key.lower().endswith(extensions) and o.key.count("/") == 1]
    if not keys:
        raise ValueError(f"{storage.url}: no {'/'.join(extensions)} files in class "
                         "sub-folders")
    classes = sorted({k.split("/", 1)[0] for k in keys})
    index = {name: i for i, name in enumerate(classes)}
    return keys, [index[k.split("/", 1)[0]] for k in keys]
