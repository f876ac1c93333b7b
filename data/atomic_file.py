"""Replace a small text file whole: readers see the old file or the new one, never a
part. Used for metadata, configs and checkpoint state (data/ is the lowest room, so the
trainer's rooms can use it too)."""

import os
from pathlib import Path


def write_atomically(path, text):
    """Write `text` to a temporary file beside `path` (named for this process, so ranks
    writing at once do not collide) and rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
