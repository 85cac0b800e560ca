"""Files lfm2jit writes and reads back on its own (the WGSL cache, kernel dumps, autotune.json),
written so that another user sharing the directory cannot steer them.

* ``write_atomic``: the data goes to a temp file created exclusively (``mkstemp``: a random name,
  ``O_EXCL``, never a planted symlink) beside the target, then replaces the target in one rename
  (which replaces a symlink at the target rather than following it). A reader never sees half a file.
* ``replace_with``: the same for a file a native writer (safetensors' ``serialize_file``) writes by
  name; a failed write (a full disk, a file-size limit) leaves the old file and raises an OSError
  naming the file, never a torn file or a bare SafetensorError.
* ``untrusted_reason``: why a directory's contents must not be read back (owned by another user,
  writable by the group or by everyone, a symlink), or None. A shared cache directory is then
  neither read nor written: a planted WGSL file would run as this user's kernel.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_with(path: Path, write, mode: int | None = None) -> None:
    """``write(temp_name)`` writes the file beside ``path`` (``.tmp-<name>.*``), which then replaces
    ``path`` in one rename. ``mode``: default 0o666 less the umask, as a plain open would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    os.close(fd)
    if mode is None:
        mode = 0o666 & ~_umask()
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except Exception as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            found = re.search(r"os error (\d+)", str(e))
            code = (e.errno if isinstance(e, OSError) and e.errno else int(found.group(1)) if found else errno.EIO)
            raise OSError(code, f"cannot write it: {os.strerror(code)}", str(path)) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def untrusted_reason(directory: Path) -> str | None:
    """None when ``directory`` (created here, private, when missing) is this user's own and
    writable by nobody else; else what is wrong with it."""
    directory = Path(directory)
    if not directory.exists():
        try:
            directory.mkdir(parents=True, mode=0o700)
        except OSError as e:
            return f"it cannot be created ({e.strerror})"
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write to it (mode {stat.filemode(info.st_mode)})"
    return None


def read_own_file(path: Path) -> bytes | None:
    """A regular file's bytes if it is this user's (not a symlink), else None."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        return None
    return Path(path).read_bytes()


class CheckedFiles:
    """A cache directory of files that each start with a line holding the sha256 of the rest, so a
    truncated or edited entry reads as missing (and is written again). A directory other users may
    write is neither read nor written (``untrusted_reason``), with a warning naming ``what`` (none
    where ``what`` is None: another cache of the same directory warns)."""

    HEADER = b"lfm2jit cache entry, sha256 of the rest: "

    def __init__(self, root: Path, what: str | None, refused: str | None = None):
        self.root = Path(root)
        self.refused = refused or untrusted_reason(self.root)
        if self.refused and what is not None:
            import warnings
            warnings.warn(f"{what} {self.root} is not used: {self.refused}; point it at a directory of your own "
                          "that only you can write", stacklevel=3)

    @classmethod
    def inside(cls, cache_dir: Path, subdir: str) -> "CheckedFiles":
        """The cache in ``cache_dir / subdir``, refused (and not created) where ``cache_dir`` itself
        is not this user's own: a private subdirectory of a shared one could still be swapped."""
        return cls(Path(cache_dir) / subdir, None, untrusted_reason(Path(cache_dir)))

    def read(self, name: str) -> tuple[bytes | None, bool]:
        """The entry's contents (None where missing or damaged), and whether it was damaged."""
        raw = None if self.refused else read_own_file(self.root / name)
        if raw is None:
            return None, False
        head, _, body = raw.partition(b"\n")
        if head != self.HEADER + hashlib.sha256(body).hexdigest().encode():
            return None, True
        return body, False

    def load(self, name: str) -> bytes | None:
        return self.read(name)[0]

    def store(self, name: str, body: bytes) -> None:
        if not self.refused:
            write_atomic(self.root / name, self.HEADER + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
