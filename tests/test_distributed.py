"""Starting jax.distributed: flags checked before anything starts; clusters detected from their environment."""
import pytest

from jaxcomp.runtime import distributed


@pytest.mark.parametrize("env, name", [
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "SLURM"),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # one task: a single process
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
    ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, "Cloud TPU pod"),
    ({"TPU_WORKER_HOSTNAMES": "w0"}, None),
    ({}, None),
])
def test_detected_cluster(env, name):
  assert distributed.detected_cluster(env) == name


def test_no_flags_and_no_cluster_is_one_process():
  assert distributed.initialize(env={}) == 1


@pytest.mark.parametrize("args, message", [
    (("127.0.0.1:1234", 2, None), "missing --process-id"),
    ((None, 2, 0), "missing --coordinator"),
    (("127.0.0.1", 2, 0), "--coordinator must be HOST:PORT .*got '127.0.0.1'"),
    (("127.0.0.1:1234", 2, 2), r"--process-id must be in 0..1 for --num-processes 2, got 2"),
])
def test_bad_flags_name_the_fix(args, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize(*args, env={})
