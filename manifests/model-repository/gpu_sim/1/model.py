"""gpu_sim: a model whose whole cost is time on an emulated accelerator.

An execution of a batch of b inferences holds the server's one emulated device for
`t0 + c * b**alpha` (the usual shape of a GPU step: a fixed launch and weight-read cost, then
sub-linear growth with the batch), with t0, c and alpha read from the `parameters` of
config.pbtxt. The output is tanh of the input, so responses can be checked.

The output goes to Triton by DLPack (NumPy arrays implement `__dlpack__`), not as an array: the
Python-backend stub of Triton 2.51 was built against NumPy 1 and mis-sizes output arrays made by
NumPy 2, which fails every request (see torch_mlp's model.py).
"""

import json

import emulated_device
import numpy as np
import triton_python_backend_utils as pb_utils


def _parameter(config, key):
    return float(config["parameters"][key]["string_value"])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self._base_seconds = _parameter(config, "step_time_base_ms") / 1000.0
        self._per_item_seconds = _parameter(config, "step_time_per_item_ms") / 1000.0
        self._exponent = _parameter(config, "step_time_exponent")
        self._device = emulated_device.EmulatedDevice(
            model_name=args["model_name"],
            model_version=args["model_version"],
            instance_name=args["model_instance_name"],
        )

    def step_seconds(self, batch_size):
        return self._base_seconds + self._per_item_seconds * batch_size**self._exponent

    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy() for r in requests]
        batch_size = sum(len(x) for x in inputs)
        with self._device.occupied(batch_size=batch_size) as started:
            outputs = [np.tanh(x).astype(np.float32) for x in inputs]
            emulated_device.sleep_until(started + self.step_seconds(batch_size))
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUTPUT", y)]) for y in outputs
        ]

    def finalize(self):
        self._device.close()
