"""torch_mlp: a real, small model (an MLP, by default 256 -> 1024 -> 1024 -> 16) run with torch.

Weights come from a fixed seed, so every instance and every run computes the same function. Each
instance uses one thread, as a GPU stream would be one queue; the forward pass holds the server's
emulated device (see emulated_device.py) so that device time compares with gpu_sim's.

Three optional config parameters let the same code run on a GPU and be big enough to keep one
busy (`make gpu-check` sets them; without them it is the CPU model the benchmarks measure):
`device` (`cpu`, `cuda` or `cuda:N`), `hidden_width` and `hidden_layers`. The weights are drawn on
the CPU from the seed and then moved, so a given shape computes the same function on every device.

Tensors cross to and from Triton by DLPack between torch and Triton, never as NumPy arrays: the
Python-backend stub of Triton 2.51 (the `nvidia-pytriton` wheel) was built against NumPy 1, and
under NumPy 2 it mis-sizes output arrays ("output tensor shape does not match size of output":
every request of the first GPU check failed) and misreads input arrays. DLPack is a C struct,
the same under both (tests/integration/test_numpy2.py).
"""

import itertools
import json

import emulated_device
import torch
import torch.utils.dlpack
import triton_python_backend_utils as pb_utils

INPUT_WIDTH = 256
OUTPUT_WIDTH = 16
SEED = 20241122
DEFAULTS = {"device": "cpu", "hidden_width": "1024", "hidden_layers": "2"}


def parameters(model_config):
    """The model's settings: DEFAULTS, overridden by the config's `parameters`."""
    given = model_config.get("parameters", {})
    return {
        key: given[key]["string_value"] if key in given else default
        for key, default in DEFAULTS.items()
    }


def build_network(*, hidden_width=1024, hidden_layers=2):
    generator = torch.Generator().manual_seed(SEED)
    widths = (INPUT_WIDTH, *([hidden_width] * hidden_layers), OUTPUT_WIDTH)
    layers = []
    for width_in, width_out in itertools.pairwise(widths):
        linear = torch.nn.Linear(width_in, width_out)
        bound = width_in**-0.5
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        layers += [linear, torch.nn.ReLU()]
    # No activation after the output layer.
    return torch.nn.Sequential(*layers[:-1]).eval()


def input_tensor(request):
    """`INPUT` of one request, as a torch tensor over Triton's memory (by DLPack)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "INPUT")
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack())


def output_tensor(values):
    """`OUTPUT` handed to Triton by DLPack (see the module's docstring for why not NumPy)."""
    return pb_utils.Tensor.from_dlpack("OUTPUT", torch.utils.dlpack.to_dlpack(values.contiguous()))


class TritonPythonModel:
    def initialize(self, args):
        settings = parameters(json.loads(args["model_config"]))
        self._torch_device = torch.device(settings["device"])
        if self._torch_device.type == "cuda" and not torch.cuda.is_available():
            raise pb_utils.TritonModelException(
                f"torch_mlp: device {settings['device']!r} asked for, but torch sees no CUDA "
                f"device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
            )
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        network = build_network(
            hidden_width=int(settings["hidden_width"]),
            hidden_layers=int(settings["hidden_layers"]),
        )
        self._network = network.to(self._torch_device)
        self._device = emulated_device.EmulatedDevice(
            model_name=args["model_name"],
            model_version=args["model_version"],
            instance_name=args["model_instance_name"],
        )

    def execute(self, requests):
        inputs = [input_tensor(r) for r in requests]
        sizes = [len(x) for x in inputs]
        with self._device.occupied(batch_size=sum(sizes)), torch.inference_mode():
            batch = torch.cat(inputs).to(self._torch_device)
            # Back on the CPU before the device is released: on a GPU this waits for the kernels.
            outputs = self._network(batch).cpu().split(sizes)
        return [pb_utils.InferenceResponse([output_tensor(y)]) for y in outputs]

    def finalize(self):
        self._device.close()
