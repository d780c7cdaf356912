"""Exclusive use of a folder (a run's checkpoints, AQ-SGD tables on disk) by one process.

The lock is the file `<folder>.lock` next to the folder, held with `fcntl.flock` and holding
the owner's pid. The kernel drops a flock when its process ends, however it ends, so a lock
file left behind by a dead process is stale: the next run takes it over (and says so).
"""
import fcntl
import os
import pathlib


class FolderInUseError(RuntimeError):
  """Another process holds the folder's lock."""


class FolderLock:
  """`with FolderLock(folder, "--run-name"):` ... ; `change` names what to change to avoid a clash."""

  def __init__(self, folder, change: str):
    self.folder = pathlib.Path(folder)
    self.path = self.folder.with_name(self.folder.name + ".lock")
    self.change = change
    self.fd = None
    self.created_dirs = []  # parents this lock created; removed on release if left empty
    self.stale_pid = None  # pid written in a stale lock file that was taken over

  def acquire(self):
    missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.created_dirs = missing
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        self.remove_created_dirs()
        raise FolderInUseError(f"{self.folder} is in use by another run (pid {owner}, lock file {self.path}); wait "
                               f"for it to finish or use another {self.change}") from None
      try:
        same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:  # its owner released it between our open and flock
        same_file = False
      if same_file:
        break
      os.close(fd)
    previous = os.read(fd, 32).decode(errors="replace").strip()
    self.stale_pid = int(previous) if previous.isdigit() else None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    self.fd = fd
    return self

  def release(self):
    if self.fd is None:
      return
    os.unlink(self.path)  # while still locked: a waiting process then sees a new file (inode check above)
    os.close(self.fd)
    self.fd = None
    self.remove_created_dirs()

  def remove_created_dirs(self):
    for directory in self.created_dirs:  # innermost first
      try:
        directory.rmdir()
      except OSError:  # not empty: the run wrote there
        break

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
