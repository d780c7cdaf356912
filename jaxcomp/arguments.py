"""What an argument check takes for a count or a number: Python's bool is an int, and is neither here."""
import numbers


def is_integer(value) -> bool:
  """An integer (Python's or numpy's), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
  """A real number (int or float, Python's or numpy's), not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)
