"""Folder locks: one process per run folder / AQ-SGD table folder; stale locks taken over."""
import os
import signal
import subprocess
import sys

import pytest

from experiments import gpt2_wikitext
from experiments.cli import main
from jaxcomp.runtime.lock import FolderInUseError, FolderLock

HOLD = ("import sys, time; from jaxcomp.runtime.lock import FolderLock; FolderLock(sys.argv[1], 'x').acquire(); "
        "print('held', flush=True); time.sleep(60)")


def test_a_second_holder_is_refused_until_the_first_releases(tmp_path):
  folder = tmp_path / "out" / "run"
  with FolderLock(folder, "--run-name") as first:
    assert (tmp_path / "out" / "run.lock").read_text() == f"{os.getpid()}\n" and first.stale_pid is None
    with pytest.raises(FolderInUseError, match=f"{folder} is in use by another run \\(pid {os.getpid()}, lock file "
                                               f"{folder}.lock\\); wait for it to finish or use another --run-name"):
      FolderLock(folder, "--run-name").acquire()
  assert not (tmp_path / "out").exists()  # lock file and the folder it created are gone
  with FolderLock(folder, "--run-name"):
    pass


def test_another_process_holds_it_and_its_stale_lock_is_taken_over(tmp_path):
  folder = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(FolderInUseError, match=f"pid {holder.pid}, lock file"):
      FolderLock(folder, "--run-name").acquire()
  finally:
    holder.send_signal(signal.SIGKILL)  # dies holding it: the lock file stays, the flock goes
    holder.wait()
  assert (tmp_path / "run.lock").read_text() == f"{holder.pid}\n"
  with FolderLock(folder, "--run-name") as taken:
    assert taken.stale_pid == holder.pid


GPT2_TINY = ["--steps", "1", "--batch-size", "4", "--block-size", "32", "--train-examples", "8",
             "--eval-examples", "4", "--no-progress"]


@pytest.mark.parametrize("what", ["run", "tables"])
def test_the_cli_refuses_a_folder_in_use(tmp_path, what):
  tables = tmp_path / "tables"
  argv = ["--preset", "aqsgd-fw2-bw4", "--aqsgd-buffers", str(tables), "--out", str(tmp_path / "out"), *GPT2_TINY]
  folder, change = (tmp_path / "out" / "aqsgd-fw2-bw4", "--run-name or --out") if what == "run" else \
      (tables, "--aqsgd-buffers DIR")
  with FolderLock(folder, "test"):
    with pytest.raises(SystemExit) as exit_:
      main(gpt2_wikitext.EXPERIMENT, argv)
  assert exit_.value.code == (f"error: {folder} is in use by another run (pid {os.getpid()}, lock file {folder}.lock); "
                              f"wait for it to finish or use another {change}")
  assert not (tmp_path / "out" / "aqsgd-fw2-bw4").exists() and not tables.exists()
