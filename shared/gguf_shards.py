"""Split GGUF files: a model written in shards named `NAME-00001-of-0000N.gguf` (llama.cpp's `gguf-split`,
gguf-py's writer with a split size, what model hubs serve past ~50 GB). The first shard holds the metadata
(the config, the tokenizer), every shard some of the tensors; a model is all of them, whichever is named.
"""

from __future__ import annotations

import re
from pathlib import Path

from batchserve.shared.errors import ModelLoadError

SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_shards(path: Path) -> list[Path]:
    """The files of the model `path` is one of, in order: [path] for a file that is not a shard; every shard
    (the first holds the metadata) for one that is. ModelLoadError names a missing shard."""
    match = SHARD_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["number"]) <= count:
        raise ModelLoadError(f"{path.name}: shard {int(match['number'])} of {count} is not a shard number")
    shards = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name} is one of {count} shards; missing beside it: {', '.join(missing)}")
    return shards


def single_model(files: list[Path]) -> Path | None:
    """The first shard when `files` (a folder's *.gguf) are one model's shards or a single file, else None."""
    if len(files) == 1:
        return files[0]
    stems = {m["stem"] + m["count"] if (m := SHARD_NAME.match(f.name)) else f.name for f in files}
    if len(stems) == 1 and len(gguf_shards(files[0])) == len(files):
        return gguf_shards(files[0])[0]
    return None
