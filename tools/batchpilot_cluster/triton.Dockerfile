# A CPU stand-in for nvcr.io/nvidia/tritonserver, for clusters without a GPU or NVIDIA's registry
# (kind, this project's own node). Build from the repository root:
#   docker build -f tools/batchpilot_cluster/triton.Dockerfile -t batchpilot-triton:e2e .
# It holds what NVIDIA's image holds for manifests/triton-deployment.yaml, so that Deployment's
# triton container runs unchanged (its own command and flags, uid 1000, a read-only root, /tmp
# an emptyDir): `tritonserver` on PATH, the Python backend with the stub for this image's Python
# in tritonserver's default backend directory (/opt/tritonserver/backends/python), and numpy for
# the demo models. The server is Triton 2.51 from the `nvidia-pytriton` wheel (the only
# tritonserver binary on PyPI): its libraries go to /opt/tritonserver/lib, where the binary's
# RPATH (${ORIGIN}/../lib) looks, and on LD_LIBRARY_PATH for the backend and its stub. The demo
# models are in /models for clusters that mount nothing there; a mounted repository hides them.
# The pytriton wheel and numpy are the lock's (requirements/triton-*.txt, exported from uv.lock
# with their hashes): the server and the NumPy the virtualenv's tests run.
ARG BASE=python:3.11-slim
FROM ${BASE} AS server
WORKDIR /src
COPY requirements/triton-server.txt ./requirements/
RUN pip download --no-cache-dir --no-deps --require-hashes --dest . \
      -r requirements/triton-server.txt \
 && python -m zipfile -e nvidia_pytriton-*.whl wheel \
 && mkdir -p /opt/tritonserver/backends \
 && mv wheel/pytriton/tritonserver/bin wheel/pytriton/tritonserver/caches /opt/tritonserver/ \
 && mv wheel/pytriton/tritonserver/backends/python /opt/tritonserver/backends/python \
 && mv wheel/nvidia_pytriton.libs /opt/tritonserver/lib \
 && python_version="$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
 && mv "wheel/pytriton/tritonserver/python_backend_stubs/${python_version}/triton_python_backend_stub" \
       /opt/tritonserver/backends/python/ \
 && chmod 0755 /opt/tritonserver/bin/* /opt/tritonserver/backends/python/triton_python_backend_stub \
 && rm -rf /src

FROM ${BASE}
# numpy: Triton's triton_python_backend_utils and the demo models import it.
COPY requirements/triton-image.txt /tmp/requirements.txt
RUN pip install --no-cache-dir --require-hashes -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt \
 && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin \
      triton-server
COPY --from=server /opt/tritonserver /opt/tritonserver
COPY manifests/model-repository /models
ENV PATH=/opt/tritonserver/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/tritonserver/lib \
    PYTHONDONTWRITEBYTECODE=1
# NVIDIA's image's own user, triton-server; manifests/triton-deployment.yaml runs it as uid 1000.
USER 1000:1000
EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models"]
