# A CPU tritonserver with the demo models, for e2e tests on kind (where the real kubelet runs
# containers instead of the local cluster's pod runner). Build from the repository root:
#   docker build -f e2e/kind/triton.Dockerfile -t batchpilot-triton:e2e .
FROM python:3.11-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY sidecar ./sidecar
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[triton]"

FROM python:3.11-slim
COPY --from=wheels /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY manifests/model-repository /models
ENV PYTHONUNBUFFERED=1 \
    BATCHPILOT_CACHE=/tmp/batchpilot-cache
USER 65532:65532
EXPOSE 8000 8001 8002
ENTRYPOINT ["python", "-m", "batchpilot_harness.local_triton", "--host", "0.0.0.0", \
            "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002", \
            "--model-repository", "/models"]
CMD ["--model", "gpu_sim"]
