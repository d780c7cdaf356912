"""`python -m benchmarks.device_check`: the command (`command.main`)."""
from benchmarks.device_check import command

if __name__ == "__main__":
  command.main()
