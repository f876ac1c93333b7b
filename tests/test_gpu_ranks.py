"""What a rank decides on a GPU host, tested on this CPU one (issue 47): each decision is a
small function of what the host has (GPU count, environment, /dev entries, an error's text),
called here with a GPU host's values; the one-line errors users see are checked through the
real entry points where one exists."""

from helpers import DUMMY, compose
from trainer.host import runs_on_gpu, visible_gpu_count

ARGS = DUMMY + ["--batch-size", "2"]


# 9. A GPU is any /dev/nvidia<N> ------------------------------------------------------------


def test_gpus_are_counted_from_any_nvidia_device_node_and_cuda_visible_devices():
    container = ["nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "null"]
    assert visible_gpu_count({}, container) == 1
    assert visible_gpu_count({}, ["nvidiactl", "nvidia-uvm", "nvidia-caps"]) == 0
    eight = [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]
    assert visible_gpu_count({}, eight) == 8
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,5"}, eight) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f2c1e4a"}, eight) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,3"}, eight) == 1  # CUDA stops at an invalid entry
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, eight) == 0
    assert runs_on_gpu(compose(ARGS), {}, container)
    assert not runs_on_gpu(compose(ARGS + ["--cpu"]), {}, container)
