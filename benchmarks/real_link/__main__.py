"""`python -m benchmarks.real_link`: the command (`command.main`), or with `--worker` one stage process."""
import sys

from benchmarks.real_link import command, stage

if __name__ == "__main__":
  argv = sys.argv[1:]
  stage.worker(argv[1:]) if argv[:1] == ["--worker"] else command.main(argv)
