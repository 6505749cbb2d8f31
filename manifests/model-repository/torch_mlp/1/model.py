"""torch_mlp: a real, small model (MLP 256 -> 1024 -> 1024 -> 16) run with torch on the CPU.

Weights come from a fixed seed, so every instance and every run computes the same function. Each
instance uses one thread, as a GPU stream would be one queue; the forward pass holds the server's
emulated device (see emulated_device.py) so that device time compares with gpu_sim's.
"""

import itertools

import emulated_device
import torch
import triton_python_backend_utils as pb_utils

LAYER_WIDTHS = (256, 1024, 1024, 16)
SEED = 20241122


def build_network():
    generator = torch.Generator().manual_seed(SEED)
    layers = []
    for width_in, width_out in itertools.pairwise(LAYER_WIDTHS):
        linear = torch.nn.Linear(width_in, width_out)
        bound = width_in**-0.5
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        layers += [linear, torch.nn.ReLU()]
    # No activation after the output layer.
    return torch.nn.Sequential(*layers[:-1]).eval()


class TritonPythonModel:
    def initialize(self, args):
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        self._network = build_network()
        self._device = emulated_device.EmulatedDevice(
            model_name=args["model_name"],
            model_version=args["model_version"],
            instance_name=args["model_instance_name"],
        )

    def execute(self, requests):
        inputs = [
            torch.from_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())
            for r in requests
        ]
        sizes = [len(x) for x in inputs]
        with self._device.occupied(batch_size=sum(sizes)), torch.inference_mode():
            outputs = self._network(torch.cat(inputs)).split(sizes)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", y.numpy())]) for y in outputs]

    def finalize(self):
        self._device.close()
