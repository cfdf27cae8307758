"""Writing and reading in a checkpoint folder that others may write in too (a shared file system):
nothing is written or removed through a link planted there, nothing read blocks for ever. A save
writes into a folder it has just made (an exclusive mkdir, which fails on a link of that name),
marked as a save's by a file inside; a leftover (a save cut short) is removed only if it is such a
folder: a real one, ours, the mark inside. The files we open ourselves are created new, never
through a link. What a step folder holds is read only from regular files that are no links (a
FIFO would block its reader for ever, a link to /dev/zero feed it for ever). Each refusal is a
ValueError of one line, naming the path. Torch-free: the pre-flight checks a folder with it."""

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from titan_exp.untrusted import regular_file

# The file that marks a folder as one a save made (so a later save may remove it).
MARK = ".titan_exp-saving"
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def make_fresh(folder: Path) -> None:
    """`folder` made empty but for our mark, where nothing was (a save's leftover is removed first);
    anything else of that name (a link, a file, someone's folder) is refused."""
    if is_ours(folder):
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)  # the checkpoint folder itself: as the user named it
    try:
        os.mkdir(folder)
    except FileExistsError:
        raise ValueError(f"{folder} is {_what(folder)} that no save of this project left; remove it") from None
    with open_new(folder / MARK) as mark:
        mark.write(str(os.getpid()).encode())


def is_ours(folder: Path) -> bool:
    """Whether `folder` is a folder a save made (not a link to one): ours, with our mark inside."""
    try:
        made, mark = os.lstat(folder), os.lstat(folder / MARK)
    except OSError:
        return False
    mine = made.st_uid == mark.st_uid == os.getuid()
    return mine and stat.S_ISDIR(made.st_mode) and stat.S_ISREG(mark.st_mode)


def remove_ours(folder: Path) -> None:
    """`folder`, if a save made it (whatever else has its name stays)."""
    if is_ours(folder):
        shutil.rmtree(folder, ignore_errors=True)


def open_new(path: Path) -> BinaryIO:
    """`path`, a file created for writing: refused (FileExistsError, OSError ELOOP) where anything,
    a link included, has its name."""
    return os.fdopen(os.open(path, _NEW, 0o644), "wb")


def own_file(path: Path) -> int:
    """The size of `path`, a regular file that is no link (a step folder's file, which the job reads)."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise ValueError(f"{path} is a link to {os.readlink(path)}, not a regular file")
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror})") from None
    return regular_file(path)


def open_own(path: Path) -> BinaryIO:
    """`path` opened for reading where own_file takes it, opened so that a FIFO or a link put in
    its place meanwhile is refused too (never waited on)."""
    own_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        why = "it became a link" if err.errno == errno.ELOOP else err.strerror
        raise ValueError(f"{path} cannot be read ({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is no longer a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _what(path: Path) -> str:
    if path.is_symlink():
        return f"a link to {os.readlink(path)}"
    return "a folder" if path.is_dir() else "a file"
