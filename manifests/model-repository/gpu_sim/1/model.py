"""gpu_sim: a model whose whole cost is time on an emulated accelerator.

An execution of a batch of b inferences holds the server's one emulated device for
`t0 + c * b**alpha` (the usual shape of a GPU step: a fixed launch and weight-read cost, then
sub-linear growth with the batch), with t0, c and alpha read from the `parameters` of
config.pbtxt. The output is tanh of the input, so responses can be checked.

The Python-backend stub of Triton 2.51 (the `nvidia-pytriton` wheel) was built against NumPy 1.
Under NumPy 2 its array conversions are wrong both ways: output arrays are mis-sized (every
request fails with HTTP 500) and input arrays repeat their first element (every answer is wrong,
silently); there tensors cross by DLPack, which is right. Under NumPy 1 the conversions are right
and DLPack from a NumPy array crashes the stub (a capsule of the wrong name), so the array
conversions stay. tests/integration/test_numpy2.py runs both.
"""

import json

import emulated_device
import numpy as np
import triton_python_backend_utils as pb_utils

NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


def input_array(request):
    tensor = pb_utils.get_input_tensor_by_name(request, "INPUT")
    return np.from_dlpack(tensor) if NUMPY_2 else tensor.as_numpy()


def output_tensor(values):
    if NUMPY_2:
        return pb_utils.Tensor.from_dlpack("OUTPUT", values)
    return pb_utils.Tensor("OUTPUT", values)


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
        inputs = [input_array(r) for r in requests]
        batch_size = sum(len(x) for x in inputs)
        with self._device.occupied(batch_size=batch_size) as started:
            outputs = [np.tanh(x).astype(np.float32) for x in inputs]
            emulated_device.sleep_until(started + self.step_seconds(batch_size))
        return [pb_utils.InferenceResponse([output_tensor(y)]) for y in outputs]

    def finalize(self):
        self._device.close()
