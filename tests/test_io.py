"""treespec.io: atomic file and folder writes leave the old content or the new one, never a mix."""

from __future__ import annotations

import json
import os
import stat

import pytest

from treespec.io import (
    atomic_folder,
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    remove_temps,
    restore_folder,
)


class _Crash(Exception):
    pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_file_is_replaced_whole_and_gets_the_usual_mode(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "one\n")
    assert atomic_write_text(path, "twö\n") == path
    assert path.read_text(encoding="utf-8") == "twö\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")

    def half_then_crash(tmp):
        tmp.write_bytes(b"ne")
        raise _Crash

    with pytest.raises(_Crash):
        atomic_write(path, half_then_crash)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_json_ends_with_a_newline_and_passes_dumps_options(tmp_path):
    path = atomic_write_json(tmp_path / "x.json", {"b": "é", "a": [1]}, indent=2, ensure_ascii=False)
    text = path.read_text(encoding="utf-8")
    assert text == json.dumps({"b": "é", "a": [1]}, indent=2, ensure_ascii=False) + "\n"
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "nan.json", float("nan"), allow_nan=False)
    assert not (tmp_path / "nan.json").exists()


def test_a_folder_is_swapped_whole(tmp_path):
    final = tmp_path / "ckpt"
    atomic_folder(final, lambda tmp: (tmp / "a").write_text("1"))
    atomic_folder(final, lambda tmp: (tmp / "b").write_text("2"))
    assert sorted(p.name for p in final.iterdir()) == ["b"]  # nothing of the previous folder is left

    def crash(tmp):
        (tmp / "c").write_text("3")
        raise _Crash

    with pytest.raises(_Crash):
        atomic_folder(final, crash)
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_interrupted_swap_is_finished_and_temporaries_are_removed(tmp_path):
    final = tmp_path / "ckpt"
    aside = tmp_path / ".ckpt.old"
    aside.mkdir()
    (aside / "a").write_text("previous")  # killed between "move the old one aside" and "move the new in"
    restore_folder(final)
    assert (final / "a").read_text() == "previous" and not aside.exists()
    aside.mkdir()  # killed after the swap, before the old one was deleted
    restore_folder(final)
    assert not aside.exists() and (final / "a").is_file()

    (tmp_path / ".x.json.abc123.tmp").write_text("half")
    (tmp_path / ".ckpt.xyz.tmp").mkdir()
    remove_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
