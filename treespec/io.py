"""Atomic writes: a reader sees the previous file (or folder) or the complete new one, never a half one.

A file is written to a temporary sibling `.<name>.<random>.tmp` (same folder, so same filesystem),
flushed to disk, and moved onto its name with `os.replace` (atomic on POSIX and Windows). A folder is
built the same way and swapped in; the previous one waits aside as `.<name>.old` until the new one is in
place, and `restore_folder` puts it back if a crash came between the two moves. Temporaries that a
killed process left behind match TEMP_GLOB (`remove_temps`).

`cache_root()` is the one folder treespec keeps files in across runs (`$TREESPEC_CACHE`, default
`~/.cache/treespec`): converted models, the compiled extension, compiled steps, cost curves.

`DEFAULT_MODEL_NAME` is the name `treespec.load_model()` gives the embedded default model (the model's
`config.name_or_path`), which the cost curves' messages and the recipes' "auto" recognise it by.

This module depends on nothing in treespec: every layer (core, drafters, training, tools) may use it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMP_GLOB = ".*.tmp"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # `tools.models.load_model()` names the default model so


def cache_root() -> Path:
    """`$TREESPEC_CACHE`, default `~/.cache/treespec`: where treespec keeps files across runs."""
    return Path(os.environ.get("TREESPEC_CACHE", Path.home() / ".cache" / "treespec"))


def _modes() -> tuple[int, int]:
    """(file mode, folder mode) that plain open() / mkdir() would give under the current umask."""
    umask = os.umask(0)  # read once at import: the umask can only be read by setting it
    os.umask(umask)
    return 0o666 & ~umask, 0o777 & ~umask


_FILE_MODE, _DIR_MODE = _modes()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:  # writable: fsync needs it on Windows
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp)` to fill a temporary sibling of `path`, flush it to disk, move it onto `path`.

    If `write` raises, `path` is untouched and the temporary is removed. Returns `path` as a Path.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def atomic_write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 1, **dumps: Any) -> Path:
    """Write `json.dumps(data, indent=indent, **dumps)` and a newline to `path` atomically (UTF-8)."""
    return atomic_write_text(path, json.dumps(data, indent=indent, **dumps) + "\n")


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def restore_folder(path: str | os.PathLike) -> Path:
    """Finish an interrupted folder swap: put `.<name>.old` back if `path` is missing, else drop it."""
    path = Path(path)
    old = _aside(path)
    if old.exists():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, path)
    return path


def replace_folder(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move the complete folder `tmp` onto `path`; the previous `path` waits aside until then."""
    tmp, path = Path(tmp), Path(path)
    restore_folder(path)
    old = _aside(path)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def atomic_folder(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp)` to fill a temporary sibling folder of `path`, flush its files, swap it in.

    If `write` raises, `path` is untouched and the temporary folder is removed. Returns `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        write(tmp)
        os.chmod(tmp, _DIR_MODE)  # mkdtemp makes 0700
        for file in tmp.rglob("*"):
            if file.is_file() and not file.is_symlink():
                _fsync_file(file)
        replace_folder(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def remove_temps(folder: str | os.PathLike) -> None:
    """Delete the temporaries (TEMP_GLOB) a killed writer left in `folder`; call it only when no other
    process is writing there."""
    for stale in Path(folder).glob(TEMP_GLOB):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
